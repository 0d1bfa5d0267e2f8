import pytest
import tensorflow as tf

import tfpar


def test_default_mesh_uses_all_virtual_cpus_in_order():
    mesh = tfpar.Mesh({"data": 2, "model": 4})
    assert mesh.devices == tuple(f"CPU:{i}" for i in range(8))
    assert mesh.shape == {"data": 2, "model": 4}
    assert mesh.axis_names == ("data", "model")
    assert mesh.size == 8
    assert mesh.device_type == "CPU"
    assert repr(mesh) == "Mesh({'data': 2, 'model': 4}, devices=CPU:0..CPU:7)"


def test_dtensor_mesh_matches_axes_and_devices():
    mesh = tfpar.Mesh({"data": 2, "model": 4})
    dmesh = mesh.dtensor_mesh
    assert dmesh.dim_names == ["data", "model"]
    assert dmesh.shape() == [2, 4]
    # Row-major: device 5 sits at data row 1, model column 1.
    assert dmesh.local_device_locations()[5] == {"data": 1, "model": 1}


def test_explicit_device_subset():
    mesh = tfpar.Mesh({"model": 2}, devices=["CPU:6", "/device:CPU:7"])
    assert mesh.devices == ("CPU:6", "CPU:7")
    assert repr(mesh) == "Mesh({'model': 2}, devices=[CPU:6, CPU:7])"


def test_axis_size_of_missing_axis_is_one():
    assert tfpar.Mesh({"model": 8}).axis_size("data") == 1


def test_mesh_size_must_match_device_count():
    with pytest.raises(ValueError, match=r"multiply to 6 but 8 device"):
        tfpar.Mesh({"data": 2, "model": 3})


@pytest.mark.parametrize(
    "axes, error",
    [
        ([("data", 8)], TypeError),
        ({}, TypeError),
        ({"data": 0, "model": 8}, ValueError),
        ({"data": 2.0, "model": 4}, ValueError),
        ({"bad name": 8}, ValueError),
    ],
)
def test_bad_axes_are_rejected(axes, error):
    with pytest.raises(error, match="Received"):
        tfpar.Mesh(axes)


def test_bad_devices_are_rejected():
    with pytest.raises(ValueError, match=r"do not exist.*CPU:9"):
        tfpar.Mesh({"model": 2}, devices=["CPU:0", "CPU:9"])
    with pytest.raises(ValueError, match="distinct"):
        tfpar.Mesh({"model": 2}, devices=["CPU:0", "CPU:0"])
    with pytest.raises(TypeError, match="list of device names"):
        tfpar.Mesh({"model": 2}, devices="CPU:0")


def test_use_virtual_cpus_again_with_same_count_is_a_no_op():
    tfpar.use_virtual_cpus(8)
    assert len(tf.config.list_logical_devices("CPU")) == 8


def test_use_virtual_cpus_after_devices_exist_raises():
    with pytest.raises(RuntimeError, match=r"after TensorFlow initialised.*8 logical"):
        tfpar.use_virtual_cpus(4)


def test_use_virtual_cpus_rejects_non_positive():
    with pytest.raises(ValueError, match="Received: n=0"):
        tfpar.use_virtual_cpus(0)


def test_too_few_cpus_points_at_use_virtual_cpus():
    # What a script that forgot tfpar.use_virtual_cpus sees (here 8 CPUs
    # exist and 16 are asked for).
    with pytest.raises(ValueError, match=r"multiply to 16 but 8 device.*"
                       r"call tfpar.use_virtual_cpus\(16\) first thing"):
        tfpar.Mesh({"data": 2, "model": 8})
