"""Pictures of where values live: layout grids and a per-variable summary.

`visualize_layout(value)` prints, like `jax.debug.visualize_array_sharding`,
the global array cut into the blocks its DTensor layout makes, each block
listing the devices that hold it (and can save it as a PNG with matplotlib).
`summary(model)` prints one row per variable (path, global shape, spec,
per-device block shape and bytes) and the bytes each device holds.

Example:

>>> import keras, tfpar
>>> tfpar.use_virtual_cpus(8)
>>> strategy = tfpar.ParallelStrategy(
...     tfpar.Mesh({"data": 2, "model": 4}),
...     rules={r".*up/kernel": (None, "model")})
>>> with strategy.scope():
...     model = keras.Sequential([keras.Input((8,)),
...                               keras.layers.Dense(16, name="up")])
>>> text = tfpar.visualize.visualize_layout(model.weights[0])
>>> rows = tfpar.visualize.summary(model)
"""

import math
import re

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfpar import layout as layout_lib
from tfpar import variables as variables_lib
from tfpar.mesh import Mesh, local_device_names, short_device_name


# -- layouts -----------------------------------------------------------------


def _describe(value):
    if isinstance(value, np.ndarray):
        return f"<numpy.ndarray shape={value.shape} dtype={value.dtype}>"
    path = getattr(value, "path", None) or getattr(value, "name", None)
    shape = getattr(value, "shape", None)
    text = f"<{type(value).__module__}.{type(value).__name__}"
    if path is not None:
        text += f" {path!r}"
    if shape is not None:
        text += f" shape={tuple(shape)}"
    return text + ">"


def _is_dtensor(value):
    try:
        return bool(dtensor.is_dtensor(value))
    except Exception:  # noqa: BLE001  (non-tensor inputs raise various errors)
        return False


def _resolve(value, caller="visualize_layout"):
    """(name, tf value with a DTensor layout) for `value`, or a TypeError."""
    name = getattr(value, "path", None)
    backing = value
    if not isinstance(value, (tf.Variable, tf.Tensor)) and hasattr(value, "value"):
        backing = value.value  # a Keras Variable
    if isinstance(backing, tf.Variable):
        name = name or backing.name.split(":")[0]
    elif isinstance(backing, tf.Tensor):
        name = name or "tensor"
    if not isinstance(backing, (tf.Variable, tf.Tensor)) or not _is_dtensor(
            backing):
        raise TypeError(
            f"{caller} needs a DTensor-backed value: a Keras Variable created "
            "in `ParallelStrategy.scope()` (e.g. `model.weights[0]`), a "
            "DTensor tf.Variable, or a DTensor tensor. A plain array or a "
            "variable created outside a strategy scope has no layout. "
            f"Received: value={_describe(value)}"
        )
    return name, backing


def _layout_of(value, caller="visualize_layout"):
    if not tf.executing_eagerly():
        raise RuntimeError(
            f"{caller} reads layouts eagerly; call it outside tf.function."
        )
    name, backing = _resolve(value, caller)
    return name, backing, dtensor.fetch_layout(backing)


def _format_devices(names):
    """['CPU:0', 'CPU:4'] -> 'CPU:0,4'; runs of 3+ become 'CPU:0-7'."""
    kinds = {n.rsplit(":", 1)[0] for n in names}
    if len(kinds) != 1 or not all(n.rsplit(":", 1)[-1].isdigit() for n in names):
        return ",".join(names)
    indices = sorted(int(n.rsplit(":", 1)[-1]) for n in names)
    parts, start = [], 0
    while start < len(indices):
        end = start
        while end + 1 < len(indices) and indices[end + 1] == indices[end] + 1:
            end += 1
        if end - start >= 2:
            parts.append(f"{indices[start]}-{indices[end]}")
        else:
            parts.extend(str(i) for i in indices[start:end + 1])
        start = end + 1
    return f"{kinds.pop()}:{','.join(parts)}"


def _grid_dims(spec):
    """The (up to two) dimensions drawn as grid rows/columns, and a note."""
    rank = len(spec)
    if rank <= 2:
        return list(range(rank)), None
    sharded = [d for d, axis in enumerate(spec) if axis is not None]
    if not sharded:
        dims = [0, 1]
        why = "no dimension is sharded"
    elif len(sharded) <= 2:
        dims = sharded
        why = "the sharded dimension(s)"
    else:
        dims = sharded[:2]
        why = (f"the first two sharded dimensions; each cell also spans the "
               f"blocks of dims {tuple(sharded[2:])}")
        return dims, (f"rank-{rank} value: grid over dims {tuple(dims)} "
                      f"({why})")
    return dims, (f"rank-{rank} value: grid over dims {tuple(dims)} "
                  f"({why}); the other dims are not split")


def layout_grid(value, _caller="layout_grid"):
    """The block grid of a DTensor-backed value, as data.

    Returns a dict with "name", "shape", "spec", "mesh" ({axis: size}),
    "block_shape", "dims" (the dimensions drawn as rows and columns; for
    rank <= 2 all of them), "note" (None, or why a rank > 2 value is shown
    over `dims`), "row_ranges"/"col_ranges" ((start, stop) per grid row and
    column) and "cells": a list of rows, each a list of cells, each a sorted
    list of the device names that hold that block.

    Example:

    >>> grid = tfpar.visualize.layout_grid(model.weights[0])
    >>> grid["cells"][0][1]
    ['CPU:1', 'CPU:5']

    Args:
        value: a Keras Variable whose `.value` is a DTensor variable, a
            DTensor tf.Variable, or a DTensor tensor.
    """
    name, backing, layout = _layout_of(value, _caller)
    shape = tuple(backing.shape.as_list())
    spec = layout_lib.spec_of(layout)
    sizes = layout_lib.axis_sizes_of(layout)
    dims, note = _grid_dims(spec)
    counts = [sizes[spec[d]] if spec[d] is not None else 1 for d in dims]
    while len(counts) < 2:
        counts.insert(0, 1)  # rank 1 is one row; rank 0 one cell
    n_rows, n_cols = counts
    cells = [[[] for _ in range(n_cols)] for _ in range(n_rows)]
    devices = local_device_names(layout.mesh)
    for device, location in zip(devices, layout.mesh.local_device_locations()):
        coords = [location[spec[d]] if spec[d] is not None else 0 for d in dims]
        while len(coords) < 2:
            coords.insert(0, 0)
        cells[coords[0]][coords[1]].append(device)
    for row in cells:
        for cell in row:
            cell.sort(key=lambda n: (n.rsplit(":", 1)[0],
                                     int(n.rsplit(":", 1)[-1])
                                     if n.rsplit(":", 1)[-1].isdigit() else 0))

    def ranges(dim_position, count):
        if dim_position < 0:
            return [None]
        size = shape[dims[dim_position]]
        step = size // count
        return [(i * step, (i + 1) * step) for i in range(count)]

    offset = 2 - len(dims)
    return {
        "name": name,
        "shape": shape,
        "spec": spec,
        "mesh": sizes,
        "block_shape": layout_lib.block_shape(shape, spec, sizes),
        "dims": tuple(dims),
        "note": note,
        "row_ranges": ranges(0 - offset, n_rows),
        "col_ranges": ranges(1 - offset, n_cols),
        "cells": cells,
    }


def _render_text(grid):
    mesh = ", ".join(f"{a}={s}" for a, s in grid["mesh"].items())
    lines = [
        f"{grid['name']}: shape={grid['shape']} spec={grid['spec']} "
        f"mesh=({mesh}) block per device={grid['block_shape']}"
    ]
    if grid["note"]:
        lines.append(grid["note"])
    texts = [[_format_devices(cell) for cell in row] for row in grid["cells"]]

    def label(r):
        return "" if r is None else f"[{r[0]}:{r[1]}]"

    row_labels = [label(r) for r in grid["row_ranges"]]
    col_labels = [label(r) for r in grid["col_ranges"]]
    width = max(
        [len(t) for row in texts for t in row] + [len(c) for c in col_labels]
    ) + 2
    margin = max(len(r) for r in row_labels)
    pad = " " * (margin + 1) if margin else ""
    if any(col_labels):
        lines.append((pad + " " + " ".join(c.center(width) for c in col_labels))
                     .rstrip())
    rule = pad + "+" + "+".join("-" * width for _ in col_labels) + "+"
    lines.append(rule)
    for r_label, row in zip(row_labels, texts):
        prefix = r_label.rjust(margin) + " " if margin else ""
        lines.append(prefix + "|" + "|".join(t.center(width) for t in row)
                     + "|")
        lines.append(rule)
    return "\n".join(lines)


def _save_png(grid, path):
    try:
        from matplotlib.figure import Figure
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise ImportError(
            "visualize_layout(path=...) saves a PNG with matplotlib, which is "
            "not installed: pip install matplotlib (or pip install "
            f"'tfpar[viz]'). Received: path={path!r}"
        ) from None
    from matplotlib import colormaps

    cells = grid["cells"]
    n_rows, n_cols = len(cells), len(cells[0])
    figure = Figure(figsize=(max(3.0, 1.6 * n_cols), max(1.5, 0.9 * n_rows)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    palette = colormaps["tab20"]
    for r, row in enumerate(cells):
        for c, devices in enumerate(row):
            color = palette((r * n_cols + c) % 20)
            axes.add_patch(_rectangle(c, n_rows - 1 - r, color))
            axes.text(c + 0.5, n_rows - 1 - r + 0.5,
                      _format_devices(devices).replace(",", ",\n")
                      if len(devices) > 4 else _format_devices(devices),
                      ha="center", va="center", fontsize=9)
    axes.set_xlim(0, n_cols)
    axes.set_ylim(0, n_rows)
    axes.set_xticks([])
    axes.set_yticks([])
    title = f"{grid['name']} {grid['shape']} spec={grid['spec']}"
    axes.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, format="png")


def _rectangle(x, y, color):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), 1, 1, facecolor=color, edgecolor="black")


def visualize_layout(value, path=None, mesh=None, print_fn=print):
    """Prints which devices hold which block of a DTensor-backed value.

    Like `jax.debug.visualize_array_sharding`: the global array is cut into
    the blocks its layout makes, and each cell lists the devices holding that
    block, e.g. "CPU:0,4" for a block replicated over a data axis of size 2
    (runs of three or more devices are shortened, "CPU:0-7"). Rank 1 is one
    row of blocks; rank > 2 is drawn over its sharded dimensions (or its
    first two) and the text says so.

    Example:

    >>> with strategy.scope():   # Mesh({"data": 2, "model": 4})
    ...     model = keras.Sequential([keras.Input((8,)),
    ...                               keras.layers.Dense(16, name="up")])
    >>> _ = tfpar.visualize.visualize_layout(model.weights[0])  # (None, "model")
    sequential/up/kernel: shape=(8, 16) spec=(None, 'model') mesh=(data=2, model=4) block per device=(8, 4)
             [0:4]     [4:8]     [8:12]   [12:16]
          +---------+---------+---------+---------+
    [0:8] | CPU:0,4 | CPU:1,5 | CPU:2,6 | CPU:3,7 |
          +---------+---------+---------+---------+

    Args:
        value: a Keras Variable whose `.value` is a DTensor variable (any
            weight of a model built in `ParallelStrategy.scope()`), a DTensor
            tf.Variable, or a DTensor tensor.
        path: optional file name; also saves the picture there as a PNG
            (needs matplotlib: `pip install matplotlib`).
        mesh: optional `tfpar.Mesh`; when given, the value must live on it
            (a ValueError otherwise).
        print_fn: called with the text; None prints nothing.

    Returns:
        The text that was printed.
    """
    grid = layout_grid(value, _caller="visualize_layout")
    if mesh is not None:
        _check_mesh(value, mesh)
    text = _render_text(grid)
    if print_fn is not None:
        print_fn(text)
    if path is not None:
        _save_png(grid, path)
    return text


def _check_mesh(value, mesh):
    if not isinstance(mesh, Mesh):
        raise TypeError(
            "visualize_layout(mesh=...) needs a tfpar.Mesh or None. "
            f"Received: mesh={mesh!r}"
        )
    _, _, layout = _layout_of(value)
    own = layout.mesh
    same = (list(own.dim_names) == list(mesh.axis_names)
            and list(own.shape()) == [mesh.shape[a] for a in mesh.axis_names]
            and local_device_names(own)
            == local_device_names(mesh.dtensor_mesh))
    if not same:
        raise ValueError(
            "visualize_layout: the value does not live on the given mesh. "
            f"Received: mesh={mesh!r}; the value's mesh has axes "
            f"{dict(zip(own.dim_names, own.shape()))} on devices "
            f"{_format_devices(local_device_names(own))}."
        )


# -- summary -----------------------------------------------------------------


def _human(nbytes):
    return f"{nbytes / 1e6:,.2f} MB"


def _kind_of(variable, registry, default):
    """The kind the strategy's registry gives `variable` (the one
    `memory_per_device` counts it as), else `default`."""
    place = None if registry is None else registry.placement_of(variable)
    return default if place is None else place.kind


def _row(variable, section, kind):
    path = getattr(variable, "path", None) or variable.name
    backing = variable if isinstance(variable, tf.Variable) else variable.value
    shape = tuple(backing.shape.as_list())
    dtype = tf.as_dtype(backing.dtype)
    if _is_dtensor(backing):
        layout = dtensor.fetch_layout(backing)
        spec = layout_lib.spec_of(layout)
        block = layout_lib.block_shape(shape, spec,
                                       layout_lib.axis_sizes_of(layout))
        devices = local_device_names(layout.mesh)
    else:  # an ordinary variable: one device holds all of it
        spec = (None,) * len(shape)
        block = shape
        devices = [short_device_name(backing.device) or "CPU:0"]
    return {
        "section": section,
        "path": path,
        "kind": kind,
        "shape": shape,
        "dtype": dtype.name,
        "spec": spec,
        "block_shape": block,
        "bytes": int(math.prod(shape)) * dtype.size,
        "bytes_per_device": int(math.prod(block)) * dtype.size,
        "devices": devices,
    }


class SummaryRows(list):
    """The rows `summary` printed (a list of dicts), plus `.totals`.

    `.totals` maps each device name to {"params", "optimizer", "other",
    "total"} bytes over the listed variables; `.text` is the printed text.
    """

    totals = None
    text = None


# Above this many variables listed, `summary` prints a compact table
# (`compact=None`): a 2-layer keras-hub GPT-2 with Adam lists 114.
COMPACT_ABOVE = 40


def summary(model, strategy=None, print_fn=print, include_optimizer=True,
            compact=None):
    """Prints where every variable of `model` lives and what each device holds.

    One row per variable of `model.weights`, then of
    `model.optimizer.variables` and of `model.metrics_variables`: variable
    path, global shape, spec (one entry per dimension: the mesh axis it is
    split over, None = replicated), per-device block shape and per-device
    bytes. Before the optimizer is built (before the first `fit`) the slots
    it will create are listed too, laid out like their weights, from an
    equal optimizer built without allocating anything; an optimizer that
    cannot be rebuilt from its config shows "(slots: not built yet)".
    Then the bytes each device holds: params (trainable weights), optimizer
    (slots such as Adam moments) and other (non-trainable weights, optimizer
    counters, metric state), in bytes and MB: the same kinds and, for a
    strategy holding one model, the same totals as
    `strategy.memory_per_device()` (which counts only built slots).

    Example:

    >>> with strategy.scope():   # Mesh({"data": 2, "model": 4})
    ...     model = keras.Sequential([keras.Input((8,)),
    ...                               keras.layers.Dense(16, name="up")])
    >>> rows = tfpar.visualize.summary(model)
    >>> up = rows[0]
    >>> up["spec"], up["block_shape"], up["bytes_per_device"]
    ((None, 'model'), (8, 4), 128)

    Args:
        model: a built Keras model (typically built in
            `ParallelStrategy.scope()`).
        strategy: the `tfpar.ParallelStrategy` the model lives under, used to
            tell optimizer slots from other state; defaults to
            `model.distribute_strategy`.
        print_fn: called once per printed line; None prints nothing.
        include_optimizer: also list the optimizer's variables.
        compact: True folds rows as above, False lists every variable,
            None (the default) folds above `COMPACT_ABOVE` variables.

    Returns:
        A `SummaryRows`: a list with one dict per variable (keys "section"
            ("weights", "optimizer", "optimizer, once built", "metrics"),
        "path", "kind", "shape", "dtype", "spec", "block_shape", "bytes",
        "bytes_per_device", "devices"), with `.totals` ({device: {"params",
        "optimizer", "other", "total"}}) and `.text`.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "summary(model) needs a Keras model. "
            f"Received: model={_describe(model)}"
        )
    if not model.weights:
        raise ValueError(
            f"summary(model): model {model.name!r} has no weights yet. Build "
            "it first (give it a keras.Input or call it on data). "
            f"Received: model={_describe(model)}"
        )
    if strategy is None:
        strategy = getattr(model, "distribute_strategy", None)
    registry = getattr(getattr(strategy, "extended", None), "registry", None)
    rows = SummaryRows(_variable_rows(model, registry, include_optimizer))
    totals = variables_lib.device_bytes(
        ((row["kind"], row["devices"], row["bytes_per_device"])
         for row in rows), devices=())
    for entry in totals.values():
        entry["total"] = sum(entry.values())
    rows.totals = totals
    if compact is None:
        compact = len(rows) > COMPACT_ABOVE
    shown = _folded_rows(rows) if compact else rows
    rows.text = _render_summary(model, shown, totals, folded=(
        len(rows), len(shown)) if compact else None)
    if print_fn is not None:
        for line in rows.text.splitlines():
            print_fn(line)
    return rows


def _variable_rows(model, registry, include_optimizer):
    """The rows of `summary`: weights, optimizer variables (and the slots
    an unbuilt optimizer will make), metric state."""
    rows = [_row(variable, "weights", _kind_of(
                variable, registry, "params" if variable.trainable else "other"))
            for variable in model.weights]
    optimizer = getattr(model, "optimizer", None)
    if include_optimizer and optimizer is not None:
        counters = {id(getattr(optimizer, "iterations", None))}
        for variable in optimizer.variables:
            default = "other" if (
                id(variable) in counters
                or variable.path.endswith("learning_rate")) else "optimizer"
            rows.append(_row(variable, "optimizer",
                             _kind_of(variable, registry, default)))
        if not optimizer.built:
            rows.extend(_predicted_slot_rows(optimizer, model, rows))
    for variable in model.metrics_variables:  # "other", as for the strategy
        rows.append(_row(variable, "metrics",
                         _kind_of(variable, registry, "other")))
    return rows


def _predicted_slot_rows(optimizer, model, weight_rows):
    """Rows of the slots an unbuilt Keras `optimizer` will create for
    `model` (section "optimizer, once built"), each laid out like its
    weight, as the strategy lays slots out; [] if they cannot be known.

    An equal optimizer is built on the model's trainable weights inside a
    `keras.StatelessScope`, where its zero-initialised slots stay
    uninitialised: nothing is allocated.
    """
    by_path = {row["path"]: row for row in weight_rows
               if row["section"] == "weights"}
    made = []  # (reference weight, slot Keras variable)
    try:
        clone = type(optimizer).from_config(optimizer.get_config())
        original = clone.add_variable_from_reference

        def add_variable_from_reference(reference, *args, **kwargs):
            slot = original(reference, *args, **kwargs)
            made.append((reference, slot))
            return slot

        clone.add_variable_from_reference = add_variable_from_reference
        with keras.StatelessScope():
            clone.build(model.trainable_variables)
    except Exception:  # noqa: BLE001 (a custom optimizer: not known)
        return [_NOT_BUILT]
    rows = []
    for reference, slot in made:
        weight = by_path.get(reference.path)
        shape = tuple(slot.shape)
        if weight is None:
            continue
        same = shape == weight["shape"]
        dtype = tf.as_dtype(slot.dtype)
        block = weight["block_shape"] if same else shape
        rows.append({
            "section": "optimizer, once built",
            "path": f"{optimizer.name}/{slot.path.split('/', 1)[-1]}",
            "kind": "optimizer",
            "shape": shape,
            "dtype": dtype.name,
            "spec": weight["spec"] if same else (None,) * len(shape),
            "block_shape": block,
            "bytes": int(math.prod(shape)) * dtype.size,
            "bytes_per_device": int(math.prod(block)) * dtype.size,
            "devices": weight["devices"],
        })
    return rows or [_NOT_BUILT]


# The row standing for slots that cannot be known before the optimizer is
# built (it holds no bytes).
_NOT_BUILT = {"section": "optimizer, once built",
              "path": "(slots: not built yet)", "kind": "optimizer",
              "shape": (), "dtype": "float32", "spec": (), "block_shape": (),
              "bytes": 0, "bytes_per_device": 0, "devices": []}


# A number in a path: the block index that tells repeated weights apart.
_NUMBER = re.compile(r"(\d+)")
_SLOT_SECTIONS = ("optimizer", "optimizer, once built")


def _folded_rows(rows):
    """`summary`'s compact rows: one per group of `rows` alike but for a
    number in their paths, one per kind of optimizer slot (its path's
    last "_" word, e.g. "momentum"), each group's rows on the same devices
    (a pipeline's stages fold apart); bytes summed over the group."""
    groups = {}
    for row in rows:
        devices = tuple(row["devices"])
        slots = _slot_pattern(row)
        if slots is not None:
            key = (row["section"], slots, devices)
        else:
            key = (row["section"], _NUMBER.sub("#", row["path"]),
                   row["shape"], row["spec"], row["block_shape"],
                   row["bytes_per_device"], devices)
        groups.setdefault(key, []).append(row)
    return [group[0] if len(group) == 1 else _fold(group)
            for group in groups.values()]


def _slot_pattern(row):
    """"sgd/*_momentum" for an optimizer slot's row, else None."""
    if (row["section"] not in _SLOT_SECTIONS or row["kind"] != "optimizer"
            or "/" not in row["path"]):
        return None
    owner, name = row["path"].split("/", 1)
    return f"{owner}/*_{name.rsplit('_', 1)[-1]}"


def _fold(group):
    """One row standing for `group`: its slot pattern, or the path with its
    varying numbers as a range ("{0..11}", or "*" if not consecutive),
    "(xN)", shape and spec shared or "(various)", bytes summed."""
    path = _slot_pattern(group[0])
    if path is None:  # alike paths: the same numbers of parts
        parts = [_NUMBER.split(row["path"]) for row in group]
        path = "".join(
            _span([p[i] for p in parts]) if i % 2 else parts[0][i]
            for i in range(len(parts[0])))

    def shared(key):
        values = {row[key] for row in group}
        return values.pop() if len(values) == 1 else "(various)"

    return {**group[0], "path": f"{path} (x{len(group)})",
            "shape": shared("shape"), "spec": shared("spec"),
            "block_shape": shared("block_shape"),
            "bytes_per_device": sum(r["bytes_per_device"] for r in group)}


def _span(numbers):
    """"3" if all equal; "{0..11}" if consecutive; else "*"."""
    values = sorted({int(n) for n in numbers})
    if len(values) == 1:
        return numbers[0]
    if values == list(range(values[0], values[-1] + 1)):
        return f"{{{values[0]}..{values[-1]}}}"
    return "*"


def _spec_text(spec):
    if isinstance(spec, str):
        return spec
    return "replicated" if all(s is None for s in spec) else str(spec)


def _render_summary(model, rows, totals, folded=None):
    header = ("variable", "shape", "spec", "block/device", "bytes/device")
    table = []
    for row in rows:
        spec = _spec_text(row["spec"])
        table.append((row["path"], str(row["shape"]), spec,
                      str(row["block_shape"]), f"{row['bytes_per_device']:,}"))
    widths = [max([len(header[i])] + [len(t[i]) for t in table])
              for i in range(len(header))]

    def line(cells):
        return "  ".join(
            c.rjust(w) if i == len(cells) - 1 else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    rule = "-" * len(line(header))
    lines = [f"Model {model.name!r}: where each variable lives"]
    if folded is not None:
        lines.append(
            f"(compact: {folded[0]} variables in {folded[1]} rows; a row "
            "\"(xN)\" stands for N alike, its bytes their total; "
            "summary(model, compact=False) lists each)")
    lines += [rule, line(header)]
    section = None
    for row, cells in zip(rows, table):
        if row["section"] != section:
            section = row["section"]
            title = {"optimizer": "optimizer variables",
                     "metrics": "metric state",
                     "optimizer, once built": "optimizer slots the first "
                     "step will create (not built yet)"}.get(section, section)
            lines += [rule, title]
        lines.append(line(cells))
    lines.append(rule)

    # Devices holding identical totals share one line.
    groups = {}
    for device, entry in totals.items():
        key = tuple(entry[k] for k in (*variables_lib.KINDS, "total"))
        groups.setdefault(key, []).append(device)
    lines.append("per device:")
    for (params, opt, other, total), devices in groups.items():
        who = (f"each of {len(devices)} devices ({_format_devices(devices)})"
               if len(devices) > 1 else devices[0])
        lines.append(
            f"  {who}: params {params:,} B ({_human(params)}), optimizer "
            f"{opt:,} B ({_human(opt)}), other {other:,} B ({_human(other)}), "
            f"total {total:,} B ({_human(total)})")
    return "\n".join(lines)
