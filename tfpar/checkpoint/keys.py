"""Which variables a checkpoint holds, under which keys.

Keys are stable across meshes, optimizer names and rebuilds (see
`tfpar.checkpoint`): a weight's path, "<weight path>:<slot>" for an
optimizer slot, the name of any other optimizer variable (of a
MultiOptimizer's i-th sub-optimizer: "optimizers/<i>/<name>"). A
`tfpar.PipelineModel` (a `training.StagedModel`) saves the slots of every
stage's optimizer under the same keys as the plain model's.
"""

import keras

from tfpar import training


def entries(model, optimizer):
    """[(kind, key, keras variable)] of everything a checkpoint holds."""
    entries = [("params", v.path, v) for v in model.weights]
    if optimizer:
        opt = getattr(model, "optimizer", None)
        if opt is None:
            raise ValueError(
                f"Model {model.name!r} has no optimizer (not compiled). "
                "Compile it, or pass optimizer=False to save/restore the "
                "weights only.")
        build_optimizer(model)
        trainable = list(model.trainable_variables)
        # A tfpar.PipelineModel has one optimizer per stage: the slots of
        # all of them, the counters of the main one (the others mirror it),
        # so its checkpoints are those of the plain model.
        staged = isinstance(model, training.StagedModel)
        # The slots of tied weights' copies mirror the weights' own.
        mirrors = {id(v) for v in model.tied_copy_state()} if staged else ()
        for stage_opt in (model.stage_optimizers if staged else None) or [opt]:
            delegated = _delegated_prefixes(stage_opt)
            for variable in stage_opt.variables:
                key = _optimizer_key(variable, trainable)
                if ":" not in key:
                    key = delegated.get(id(variable), "") + key
                if id(variable) in mirrors:
                    continue
                if stage_opt is opt or ":" in key:
                    entries.append(("optimizer", key, variable))
    seen, duplicates = set(), []
    for kind, key, _ in entries:
        if (kind, key) in seen:
            duplicates.append(key)
        seen.add((kind, key))
    if duplicates:
        raise ValueError(
            f"Variables of model {model.name!r} share the checkpoint key(s) "
            f"{duplicates}. Give the layers unique names.")
    return entries


def _delegated_prefixes(optimizer):
    """{id(variable): "optimizers/<i>/"} for the variables of a
    MultiOptimizer's i-th sub-optimizer, whose counters and learning rates
    share their names with the MultiOptimizer's own and each other's."""
    if not isinstance(optimizer, keras.optimizers.MultiOptimizer):
        return {}
    return {id(variable): f"optimizers/{i}/"
            for i, inner in enumerate(optimizer.optimizers)
            for variable in inner.variables}


def _optimizer_key(variable, trainable):
    """"<weight path>:<slot>" for a slot, else the variable's name."""
    name = variable.name
    best = None
    for weight in trainable:
        prefix = weight.path.replace("/", "_") + "_"
        if (name.startswith(prefix) and len(name) > len(prefix)
                and tuple(weight.shape) == tuple(variable.shape)
                and (best is None or len(prefix) > len(best[0]))):
            best = (prefix, weight.path)
    if best is None:
        return name
    return f"{best[1]}:{name[len(best[0]):]}"


def build_optimizer(model):
    if isinstance(model, training.StagedModel):
        model.stage_optimizers  # noqa: B018 (builds each stage's optimizer)
        return
    opt = getattr(model, "optimizer", None)
    if opt is not None and not opt.built:
        with model.distribute_strategy.scope():
            opt.build(model.trainable_variables)
