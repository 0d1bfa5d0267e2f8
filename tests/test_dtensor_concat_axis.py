"""Why tfpar's steps pin Keras' concatenate's joined dimension whole
(`tfpar.spmd_ops.concatenate_whole_along_axis`).

On TF 2.21 DTensor concatenates each device's blocks when a consumer splits
the joined dimension and the axis is negative (a wrong result, no error),
and refuses the same split for a non-negative axis
(tests/dtensor_concat_axis_repro.py). If the first assertion starts failing
on a newer TF, DTensor lays the concat out itself and the pin can go.
"""

import dtensor_concat_axis_repro


def test_negative_axis_concat_is_wrong_and_pinned_one_is_right():
    found = dtensor_concat_axis_repro.results()
    assert found == {
        "concat(axis=-1) * g": "wrong",
        "concat(axis=1) * g": "fails: Concat op SPMD with concat dimension in "
                              "sharded dimension is not supported.",
        "relayout(concat(axis=-1), whole columns) * g": "right",
    }, found
