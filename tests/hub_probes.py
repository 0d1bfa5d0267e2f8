"""keras-hub backbones beyond tests/hub_models.py, each with a probe head.

Small backbones built from constructor arguments (no preset download),
each given a Dense "probe" of 4 units on its (decoder's) sequence output,
trained with MSE: every weight of the backbone trains, whatever its task
head would be. `train(name, strategy)` fits one the same way on one device
(`strategy` None) or planned by `tfpar.auto_rules` on a strategy's mesh.
Used by tests/test_auto_rules_merged_heads.py and
tests/test_keras_hub_more.py.
"""

import warnings

import keras
import keras_hub
import numpy as np
from keras.src.utils import naming

import tfpar

import models

HEADS, HEAD_DIM, SEQ = 4, 8, 16
# Moonshine's audio front end (convolutions of 127 samples, stride 64,
# then 7 / 3 and 3 / 2) needs at least 1024 samples for one frame.
AUDIO_SAMPLES = 1024
HIDDEN = HEADS * HEAD_DIM
VOCAB, FFN = 256, 64
_M = keras_hub.models
_TEXT = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=HIDDEN,
             intermediate_dim=FFN)

BACKBONES = {
    # attention with heads made or merged by reshapes
    "gpt_neox": lambda: _M.GPTNeoXBackbone(
        num_heads=HEADS, max_sequence_length=SEQ, **_TEXT),
    "smollm3": lambda: _M.SmolLM3Backbone(
        vocabulary_size=VOCAB, hidden_dim=2 * HIDDEN, intermediate_dim=FFN,
        num_layers=2, num_attention_heads=2 * HEADS,
        num_key_value_heads=HEADS, attention_bias=False,
        attention_dropout=0.0, rope_layer_enabled_list=[True, False],
        layer_types=["attention", "attention"], mlp_bias=False,
        layer_norm_epsilon=1e-6, max_position_embeddings=SEQ,
        rope_theta=10000.0, partial_rotary_factor=1.0),
    "t5": lambda: _M.T5Backbone(num_heads=HEADS, **_TEXT),
    "esm2": lambda: _M.ESM2Backbone(num_heads=HEADS, **_TEXT),
    "roformer_v2": lambda: _M.RoformerV2Backbone(
        num_heads=HEADS, head_size=HEAD_DIM, **_TEXT),
    # other keras-hub families
    "xlnet": lambda: _M.XLNetBackbone(num_heads=HEADS, **_TEXT),
    "opt": lambda: _M.OPTBackbone(
        num_heads=HEADS, max_sequence_length=SEQ, **_TEXT),
    "bloom": lambda: _M.BloomBackbone(num_heads=HEADS, **_TEXT),
    "falcon": lambda: _M.FalconBackbone(num_attention_heads=HEADS, **_TEXT),
    "phi3": lambda: _M.Phi3Backbone(
        num_query_heads=HEADS, num_key_value_heads=HEADS, **_TEXT),
    "qwen": lambda: _M.QwenBackbone(
        num_query_heads=HEADS, num_key_value_heads=HEADS, **_TEXT),
    "gemma3": lambda: _M.Gemma3Backbone(
        image_size=None, num_query_heads=HEADS, num_key_value_heads=HEADS,
        head_dim=HEAD_DIM, **_TEXT),
    "deberta_v3": lambda: _M.DebertaV3Backbone(
        num_heads=HEADS, max_sequence_length=SEQ, **_TEXT),
    "bart": lambda: _M.BartBackbone(
        num_heads=HEADS, max_sequence_length=SEQ, **_TEXT),
    "whisper": lambda: _M.WhisperBackbone(
        num_heads=HEADS, max_encoder_sequence_length=SEQ,
        max_decoder_sequence_length=SEQ, **_TEXT),
    "dinov2": lambda: _M.DINOV2Backbone(
        patch_size=4, num_layers=2, hidden_dim=HIDDEN, num_heads=HEADS,
        intermediate_dim=FFN, image_shape=(16, 16, 3)),
    "swin": lambda: _M.SwinTransformerBackbone(
        image_shape=(16, 16, 3), embed_dim=16, depths=[2], num_heads=[2],
        window_size=2, patch_size=2),
    "mit": lambda: _M.MiTBackbone(
        layerwise_depths=[1, 1], num_layers=2, layerwise_num_heads=[1, 2],
        layerwise_sr_ratios=[2, 1], max_drop_path_rate=0.0,
        layerwise_patch_sizes=[3, 3], layerwise_strides=[2, 2],
        image_shape=(16, 16, 3), hidden_dims=[8, 16]),
    "qwen2": lambda: _M.Qwen2Backbone(
        num_query_heads=HEADS, num_key_value_heads=2, **_TEXT),
    "qwen3": lambda: _M.Qwen3Backbone(
        num_query_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM,
        **_TEXT),
    "qwen3_5_moe": lambda: _M.Qwen3_5MoeBackbone(
        vocabulary_size=VOCAB, num_layers=2, hidden_dim=HIDDEN,
        num_query_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM,
        moe_intermediate_dim=16, shared_expert_intermediate_size=16,
        num_experts=4, top_k=2),
    "gemma4": lambda: _M.Gemma4Backbone(
        image_size=None, num_query_heads=HEADS, num_key_value_heads=2,
        head_dim=HEAD_DIM, **_TEXT),
    "t5gemma": lambda: _M.T5GemmaBackbone(
        vocabulary_size=VOCAB, encoder_hidden_dim=HIDDEN,
        encoder_intermediate_dim=FFN, encoder_num_layers=2,
        encoder_num_attention_heads=HEADS, encoder_num_key_value_heads=HEADS,
        encoder_head_dim=HEAD_DIM, encoder_layer_types=["full_attention"] * 2,
        decoder_hidden_dim=HIDDEN, decoder_intermediate_dim=FFN,
        decoder_num_layers=2, decoder_num_attention_heads=HEADS,
        decoder_num_key_value_heads=HEADS, decoder_head_dim=HEAD_DIM,
        decoder_layer_types=["full_attention"] * 2),
    "t5gemma2": lambda: _M.T5Gemma2Backbone(
        vocabulary_size=VOCAB, encoder_hidden_dim=HIDDEN,
        encoder_intermediate_dim=FFN, encoder_num_layers=2,
        encoder_num_attention_heads=HEADS, encoder_num_key_value_heads=HEADS,
        encoder_head_dim=HEAD_DIM,
        encoder_layer_types=["sliding_attention", "full_attention"],
        decoder_hidden_dim=HIDDEN, decoder_intermediate_dim=FFN,
        decoder_num_layers=2, decoder_num_attention_heads=HEADS,
        decoder_num_key_value_heads=HEADS, decoder_head_dim=HEAD_DIM,
        decoder_layer_types=["sliding_attention", "full_attention"],
        sliding_window=SEQ, cross_attention_hidden_size=HIDDEN,
        eoi_token_index=VOCAB - 1),
    "electra": lambda: _M.ElectraBackbone(
        vocab_size=VOCAB, num_layers=2, num_heads=HEADS, hidden_dim=HIDDEN,
        embedding_dim=HIDDEN, intermediate_dim=FFN, max_sequence_length=SEQ),
    "roberta": lambda: _M.RobertaBackbone(
        num_heads=HEADS, max_sequence_length=SEQ, **_TEXT),
    "xlm_roberta": lambda: _M.XLMRobertaBackbone(
        num_heads=HEADS, max_sequence_length=SEQ, **_TEXT),
    "distil_bert": lambda: _M.DistilBertBackbone(
        num_heads=HEADS, max_sequence_length=SEQ, **_TEXT),
    "albert": lambda: _M.AlbertBackbone(
        num_heads=HEADS, embedding_dim=16, max_sequence_length=SEQ, **_TEXT),
    "f_net": lambda: _M.FNetBackbone(max_sequence_length=SEQ, **_TEXT),
    "esm": lambda: _M.ESMBackbone(num_heads=HEADS, **_TEXT),
    "vitdet": lambda: _M.ViTDetBackbone(
        hidden_size=HIDDEN, num_layers=2, intermediate_dim=FFN,
        num_heads=HEADS, global_attention_layer_indices=[1],
        image_shape=(32, 32, 3), patch_size=8, window_size=2),
    "dinov3": lambda: _M.DINOV3Backbone(
        patch_size=4, num_layers=2, hidden_dim=HIDDEN, num_heads=HEADS,
        intermediate_dim=FFN, image_shape=(16, 16, 3)),
    "gemma3n": lambda: _M.Gemma3nBackbone(
        text_vocab_size=VOCAB, text_hidden_size=HIDDEN, num_hidden_layers=2,
        pad_token_id=0, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, head_dim=HEAD_DIM,
        intermediate_size=[FFN, FFN], hidden_activation="gelu_approximate",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8, rope_theta=10000.0, max_position_embeddings=SEQ,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
        altup_num_inputs=2, laurel_rank=4),
    "moonshine": lambda: _M.MoonshineBackbone(
        vocabulary_size=VOCAB, filter_dim=HIDDEN, encoder_num_layers=2,
        decoder_num_layers=2, hidden_dim=HIDDEN, intermediate_dim=FFN,
        encoder_num_heads=HEADS, decoder_num_heads=HEADS),
    "edrec": lambda: _M.EdRecBackbone(
        vocab_size=VOCAB, num_layers_enc=2, num_layers_dec=2,
        hidden_dim=HIDDEN, intermediate_dim=FFN, num_heads=HEADS),
    # a recurrence (the generalized delta rule) written with a TensorArray
    "rwkv7": lambda: _M.RWKV7Backbone(
        hidden_size=HIDDEN, head_size=HEAD_DIM, num_layers=2,
        vocabulary_size=VOCAB, intermediate_dim=FFN, gate_lora=8, mv_lora=8,
        aaa_lora=8, decay_lora=8),
    # Qwen3.5's dense model: linear-attention and full-attention layers
    "qwen3_5": lambda: _M.Qwen3_5Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=HEADS,
        num_key_value_heads=2, head_dim=HEAD_DIM, hidden_dim=HIDDEN,
        intermediate_dim=FFN, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8),
    "deit": lambda: _M.DeiTBackbone(
        image_shape=(16, 16, 3), patch_size=4, num_layers=2,
        num_heads=HEADS, hidden_dim=HIDDEN, intermediate_dim=FFN),
}


IMAGE = (32, 32, 3)
_VIT = dict(num_layers=2, num_heads=HEADS, hidden_dim=HIDDEN)  # 2-layer ViTs


def _resnet(stages=3, image_shape=IMAGE):
    """A small ResNet (keras-hub requires 64 filters in its first stack),
    its `stages` strided 1, then 2."""
    return _M.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64] * stages, stackwise_num_blocks=[1] * stages,
        stackwise_num_strides=[1] + [2] * (stages - 1),
        block_type="basic_block", use_pre_activation=False,
        image_shape=image_shape)


def _dfine():
    """D-FINE on a small HGNetV2, 8 queries, no denoising."""
    hgnet = _M.HGNetV2Backbone(
        stem_channels=[3, 8, 8],
        stackwise_stage_filters=[[8, 8, 16, 1, 1, 3], [16, 8, 32, 1, 1, 3]],
        apply_downsample=[False, True],
        use_lightweight_conv_block=[False, False], depths=[1, 1],
        hidden_sizes=[16, 32], embedding_size=8,
        use_learnable_affine_block=True, hidden_act="relu",
        image_shape=IMAGE, out_features=["stage1", "stage2"])
    return _M.DFineBackbone(
        backbone=hgnet, decoder_in_channels=[32, 32], encoder_hidden_dim=32,
        num_denoising=0, num_labels=4, hidden_dim=32,
        learn_initial_query=False, num_queries=8, anchor_image_size=(32, 32),
        feat_strides=[4, 8], num_feature_levels=2,
        encoder_in_channels=[16, 32], encode_proj_layers=[1],
        num_attention_heads=HEADS, encoder_ffn_dim=FFN,
        num_encoder_layers=1, hidden_expansion=0.5, depth_multiplier=0.5,
        eval_idx=-1, num_decoder_layers=2, decoder_attention_heads=HEADS,
        decoder_ffn_dim=FFN, decoder_n_points=[2, 2], lqe_hidden_dim=16,
        num_lqe_layers=2, out_features=["stage1", "stage2"],
        image_shape=IMAGE, seed=0)


def _blip2():
    """BLIP-2: a ViT, a Q-Former of 4 queries and an OPT."""
    common = dict(num_layers=2, num_heads=HEADS, hidden_dim=HIDDEN,
                  intermediate_dim=FFN)
    vision = _M.BLIP2VisionEncoder(
        image_size=32, patch_size=8, use_patch_bias=True,
        use_class_token=True, use_mha_bias=True, use_mlp_bias=True,
        dropout_rate=0.0, layer_norm_epsilon=1e-6, initializer_range=0.02,
        **common)
    qformer = _M.BLIP2QFormer(
        num_query_tokens=4, vision_dim=HIDDEN, cross_attention_frequency=1,
        dropout=0.0, layer_norm_epsilon=1e-6, **common)
    language = _M.BLIP2CustomOPT(
        vocabulary_size=VOCAB, num_query_tokens=4, dropout=0.0,
        max_sequence_length=SEQ + 4, qformer_hidden_dim=HIDDEN, **common)
    return _M.BLIP2Backbone(vision_encoder=vision, qformer=qformer,
                            language_model=language)


def _clip(family="CLIP"):
    """CLIP (or MetaCLIP2 or SigLIP, `family`): a ViT and a text encoder
    (CLIP's projected to one width); its outputs are the batch-by-batch
    logits."""
    common = dict(hidden_dim=HIDDEN, num_layers=2, num_heads=HEADS,
                  intermediate_dim=FFN)
    vision = getattr(_M, f"{family}VisionEncoder")(
        patch_size=8, image_shape=IMAGE, name="vision_encoder", **common)
    text = getattr(_M, f"{family}TextEncoder")(
        vocabulary_size=VOCAB, embedding_dim=HIDDEN, max_sequence_length=SEQ,
        name="text_encoder", **common)
    projection = {} if family == "SigLIP" else dict(projection_dim=HIDDEN)
    return getattr(_M, f"{family}Backbone")(
        vision_encoder=vision, text_encoder=text, **projection)


def _sam():
    """SAM: a windowed ViTDet image encoder (4x4 embeddings), the prompt
    encoder (points, boxes, 16x16 masks) and the mask decoder applied to
    the backbone's outputs, as keras-hub's SAMImageSegmenter does."""
    image_encoder = _M.ViTDetBackbone(
        hidden_size=HIDDEN, num_layers=2, intermediate_dim=FFN,
        num_heads=HEADS, global_attention_layer_indices=[1],
        image_shape=IMAGE, patch_size=8, num_output_channels=HIDDEN,
        window_size=2)
    prompt_encoder = keras_hub.layers.SAMPromptEncoder(
        hidden_size=HIDDEN, image_embedding_size=(4, 4),
        input_image_size=IMAGE[:2], mask_in_channels=16)
    mask_decoder = keras_hub.layers.SAMMaskDecoder(
        hidden_size=HIDDEN, num_layers=2, intermediate_dim=FFN,
        num_heads=HEADS, embedding_dim=HIDDEN, num_multimask_outputs=3,
        iou_head_depth=2, iou_head_hidden_dim=HIDDEN)
    backbone = _M.SAMBackbone(image_encoder=image_encoder,
                              prompt_encoder=prompt_encoder,
                              mask_decoder=mask_decoder)
    # One prompt mask per image: (batch, 1, 16, 16, 1).
    inputs = dict(backbone.input, masks=keras.Input((16, 16, 1),
                                                    name="masks"))
    prompts = backbone(dict(inputs, masks=keras.ops.expand_dims(
        inputs["masks"], 1)))
    return keras.Model(inputs, mask_decoder(**prompts))


def _paligemma():
    """PaliGemma: a ViT of 16 patches before a Gemma decoder."""
    return _M.PaliGemmaBackbone(
        vocabulary_size=VOCAB, image_size=32, num_layers=2,
        num_query_heads=HEADS, num_key_value_heads=HEADS, hidden_dim=HIDDEN,
        intermediate_dim=FFN, head_dim=HEAD_DIM, vit_patch_size=8,
        vit_num_heads=HEADS, vit_hidden_dim=HIDDEN, vit_num_layers=2,
        vit_intermediate_dim=FFN)


def _depth_anything():
    """Depth Anything: a DINOv2 encoder, its two stages reassembled and
    fused into a depth map."""
    encoder = _M.DINOV2Backbone(
        patch_size=4, intermediate_dim=FFN, image_shape=IMAGE,
        position_embedding_shape=IMAGE, apply_layernorm=True,
        name="image_encoder", **_VIT)
    return _M.DepthAnythingBackbone(
        image_encoder=encoder, reassemble_factors=[2, 1],
        neck_hidden_dims=[16, HIDDEN], fusion_hidden_dim=16,
        head_hidden_dim=16, head_in_index=-1,
        feature_keys=["stage1", "stage2"])


def _parseq():
    """PARSeq: a ViT and a 1-layer permuted autoregressive decoder."""
    encoder = _M.ViTBackbone(
        image_shape=IMAGE, patch_size=8, mlp_dim=FFN, use_class_token=False,
        name="image_encoder", **_VIT)
    return _M.PARSeqBackbone(
        image_encoder=encoder, vocabulary_size=VOCAB,
        max_label_length=SEQ - 1, decoder_hidden_dim=HIDDEN,
        num_decoder_layers=1, num_decoder_heads=HEADS, decoder_mlp_dim=FFN,
        dropout_rate=0.0, attention_dropout=0.0)


def _flux():
    """Flux: one double-stream and one single-stream block over 16 image
    and 16 text tokens."""
    return _M.FluxBackbone(
        input_channels=HIDDEN, hidden_size=HIDDEN, mlp_ratio=1.0,
        num_heads=HEADS, depth=1, depth_single_blocks=1, axes_dim=[2, 2, 4],
        theta=10_000, use_bias=True, guidance_embed=True,
        image_shape=(SEQ, HIDDEN), text_shape=(SEQ, HIDDEN),
        image_ids_shape=(SEQ, 3), text_ids_shape=(SEQ, 3),
        y_shape=(HIDDEN,))


VISION = {
    "d_fine": _dfine,
    "blip2": _blip2,
    "clip": _clip,
    "metaclip2": lambda: _clip("MetaCLIP2"),
    "siglip": lambda: _clip("SigLIP"),
    "sam": _sam,
    "flux": _flux,
    "paligemma": _paligemma,
    "depth_anything": _depth_anything,
    "parseq": _parseq,
    "video_prism": lambda: _M.VideoPrismBackbone(
        num_frames=4, patch_size=8, hidden_dim=HIDDEN, intermediate_dim=FFN,
        num_heads=HEADS, num_spatial_layers=2, num_temporal_layers=2,
        num_auxiliary_layers=1, vocabulary_size=VOCAB, num_text_layers=2,
        image_shape=IMAGE),
    "segformer": lambda: _M.SegFormerBackbone(  # on MiT's two stages
        image_encoder=BACKBONES["mit"](), projection_filters=HIDDEN),
}
# Convolutional backbones: no attention, so `auto_rules` splits nothing;
# they train data parallel (tests/test_keras_hub_more.py).
CONVOLUTIONAL = {
    "deeplab_v3": lambda: _M.DeepLabV3Backbone(
        image_encoder=_resnet(), spatial_pyramid_pooling_key="P4",
        low_level_feature_key="P2", upsampling_size=4,
        dilation_rates=[1, 2, 3], projection_filters=16, image_shape=IMAGE),
    "cspnet": lambda: _M.CSPNetBackbone(
        stem_filters=16, stem_kernel_size=3, stem_strides=1,
        stackwise_depth=[1, 1], stackwise_strides=2,
        stackwise_num_filters=[32, 64], block_type="dark_block",
        stage_type="csp", down_growth=True, bottle_ratio=(0.5, 1.0),
        block_ratio=(1.0, 0.5), expand_ratio=(2.0, 1.0),
        stem_padding="same", image_shape=IMAGE),
    "vgg": lambda: _M.VGGBackbone(
        stackwise_num_repeats=[1, 1], stackwise_num_filters=[16, 32],
        image_shape=IMAGE),
    "mobilenet_v5": lambda: _M.MobileNetV5Backbone(
        stackwise_block_types=[["er"], ["uir", "uir"]],
        stackwise_num_blocks=[1, 2], stackwise_num_filters=[[24], [48, 48]],
        stackwise_strides=[[2], [2, 1]],
        stackwise_act_layers=[["relu"], ["relu", "relu"]],
        stackwise_exp_ratios=[[2.0], [2.0, 2.0]],
        stackwise_se_ratios=[[0.0], [0.0, 0.0]],
        stackwise_dw_kernel_sizes=[[0], [3, 3]],
        stackwise_dw_start_kernel_sizes=[[0], [0, 0]],
        stackwise_dw_end_kernel_sizes=[[0], [0, 0]],
        stackwise_exp_kernel_sizes=[[3], [0, 0]],
        stackwise_pw_kernel_sizes=[[1], [0, 0]],
        stackwise_num_heads=[[0], [0, 0]], stackwise_key_dims=[[0], [0, 0]],
        stackwise_value_dims=[[0], [0, 0]],
        stackwise_kv_strides=[[0], [0, 0]],
        stackwise_use_cpe=[[False], [False, False]], stem_size=16,
        num_features=HIDDEN, use_msfa=False, image_shape=IMAGE),
    "retinanet": lambda: _M.RetinaNetBackbone(
        image_encoder=_resnet(stages=4), min_level=3, max_level=5,
        use_p5=True, image_shape=IMAGE),
    "efficientnet": lambda: _M.EfficientNetBackbone(
        stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1],
        stackwise_input_filters=[16, 16], stackwise_output_filters=[16, 32],
        stackwise_expansion_ratios=[1, 4],
        stackwise_squeeze_and_excite_ratios=[0.0, 0.25],
        stackwise_strides=[1, 2], stackwise_block_types=["fused", "unfused"],
        stackwise_force_input_filters=[0, 0],
        stackwise_nores_option=[False, False], width_coefficient=1.0,
        depth_coefficient=1.0, num_features=HIDDEN, input_shape=IMAGE),
    "densenet": lambda: _M.DenseNetBackbone(
        stackwise_num_repeats=[1, 1], compression_ratio=0.5, growth_rate=8,
        image_shape=IMAGE),
    "xception": lambda: _M.XceptionBackbone(
        stackwise_conv_filters=[[16, 32], [HIDDEN, HIDDEN]],
        stackwise_pooling=[False, True], image_shape=IMAGE),
}


def _basnet():
    """BASNet: its prediction and refinement modules over a ResNet's
    four stages (64 filters, BASNet's own projection width; BASNet takes
    the image shape, its encoder none)."""
    return _M.BASNetBackbone(
        image_encoder=_resnet(stages=4, image_shape=(None, None, 3)),
        num_classes=1, image_shape=IMAGE, projection_filters=64)


CONVOLUTIONAL["basnet"] = _basnet
VISION.update(CONVOLUTIONAL)
BACKBONES.update(VISION)


def _pooled_features(outputs):
    """The float outputs of known width, each averaged over its middle
    dimensions and joined: a probe input for a model whose outputs are
    feature maps, boxes and logits (D-FINE, DeepLabV3); if none has a
    known width, every output averaged over its last dimension (CLIP)."""
    features = []
    for output in keras.tree.flatten(outputs):
        if not output.dtype.startswith("float") or len(output.shape) < 2 \
                or output.shape[-1] is None:
            continue
        if len(output.shape) > 2:
            output = keras.ops.mean(
                output, axis=tuple(range(1, len(output.shape) - 1)))
        features.append(output)
    if not features:  # CLIP: (batch, batch) logits, each row averaged
        features = [keras.ops.mean(output, axis=-1, keepdims=True)
                    for output in keras.tree.flatten(outputs)]
    if len(features) == 1:
        return features[0]
    return keras.layers.Concatenate()(features)


def probe_model(name):
    """The backbone `name`, seeded, with a Dense "probe" of 4 units on its
    (decoder's) sequence output, or on its pooled outputs
    (`_pooled_features`: the VISION models)."""
    keras.utils.set_random_seed(0)
    naming.reset_uids()  # unnamed layers: the same paths every build
    backbone = BACKBONES[name]()
    output = backbone.output
    if isinstance(output, dict):
        output = output.get("decoder_sequence_output",
                            output.get("sequence_output"))
    if output is None or name in VISION:
        output = _pooled_features(backbone.output)
    return keras.Model(backbone.input,
                       keras.layers.Dense(4, name="probe")(output))


def probe_data(model, batch=16):
    """(x, y): random ids for the model's integer inputs, all-ones masks,
    zero segment ids, normal floats for its float inputs (images, audio
    features; unknown lengths SEQ, or AUDIO_SAMPLES for an audio
    encoder's); normal targets for the probe."""
    rng = np.random.default_rng(0)
    x = {}
    inputs = model.input
    if isinstance(inputs, list):  # Gemma 3n: by the inputs' names
        inputs = {t.name: t for t in inputs}
    elif not isinstance(inputs, dict):
        inputs = {"images": inputs}
    for key, spec in inputs.items():
        audio = "encoder_input_values" in inputs
        length = AUDIO_SAMPLES if audio and key.startswith("encoder") else SEQ
        shape = (batch,) + tuple(length if d is None else d
                                 for d in spec.shape[1:])
        if "mask" in key:
            x[key] = np.ones(shape, bool)
        elif "segment" in key:
            x[key] = np.zeros(shape, "int32")
        elif "int" in str(spec.dtype):
            x[key] = rng.integers(1, VOCAB, shape).astype("int32")
        else:
            x[key] = rng.normal(size=shape).astype("float32")
    out = (batch,) + tuple(SEQ if d is None else d
                           for d in model.output.shape[1:])
    if isinstance(model.input, list):
        x = [x[t.name] for t in model.input]
    elif not isinstance(model.input, dict):
        x = x["images"]
    return x, rng.normal(size=out).astype("float32")


def assert_same_weights(reference, model):
    """Every weight of `model` equals `reference`'s of the same path within
    1e-4 relative to the reference's largest value, or 1e-7 absolutely
    where that is below 1e-3: weights whose true gradient is zero (key
    biases under softmax, XLNet's segment bias on one segment) stay at
    their zero start plus float32 noise (1e-14..1e-9), which differs
    between one device and a mesh."""
    for want, got in zip(reference.weights, model.weights, strict=True):
        assert want.path == got.path, (want.path, got.path)
        a = np.asarray(want.numpy(), "float64")
        b = np.asarray(got.numpy(), "float64")
        scale = max(float(np.abs(a).max()), 1e-3)
        assert np.abs(a - b).max() <= 1e-4 * scale, (
            want.path, np.abs(a - b).max(), scale)


def train(name, strategy):
    """(model, per-batch losses) of `probe_model(name)` after one epoch of
    fit with SGD(0.1) on `probe_data` at batch 8, planned by auto_rules
    when `strategy` is given (one device when None)."""
    weights = probe_model(name).get_weights()
    x, y = probe_data(probe_model(name))

    def build():
        model = probe_model(name)
        model.set_weights(weights)
        if strategy is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the probe: whole
                strategy.apply_rules(
                    model, tfpar.auto_rules(model, mesh=strategy.mesh))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model
    return models.train_built(strategy, build, x, y, 8)


def assert_data_parallel_like_one_device(name, rtol):
    """`train(name, ...)` on data=8: the losses within `rtol` (relative)
    of one device's."""
    _, want = train(name, None)
    _, got = train(name, tfpar.ParallelStrategy(tfpar.Mesh({"data": 8})))
    assert models.relative_error(want, got) < rtol, (want, got)


def assert_trains_like_one_device(name, mesh):
    """`train(name, ...)` on `mesh` ({axis: size}) in parity with one
    device (losses 1e-4 relative, every weight by `assert_same_weights`),
    each device holding only its block of every weight split over
    "model" (at least one). Returns the compiled step's
    `tfpar.communication` programs."""
    reference, want = train(name, None)
    strategy = tfpar.ParallelStrategy(tfpar.Mesh(mesh))
    with tfpar.communication.capture() as programs:
        model, got = train(name, strategy)
    assert models.relative_error(want, got) < 1e-4, (want, got)
    assert_same_weights(reference, model)
    weights = {w.path: w for w in model.weights}
    split = [(path, spec) for path, spec, _ in strategy.placements("params")
             if "model" in spec]
    assert split, "auto_rules split nothing"
    for path, spec in split:
        models.assert_one_block_per_device(weights[path], spec)
    return programs
