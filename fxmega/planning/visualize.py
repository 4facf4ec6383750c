"""Pictures of how a tensor is split over the device mesh, like ``jax.debug.visualize_array_sharding``.

A placement list (``S(d)`` split along dim d, ``R`` replicated, ``P`` partial sum: one per
mesh axis) says which block of a tensor every rank holds; reading that off by hand is the
usual source of layout bugs, so this module draws it:

    print(grid([768, 3072], parse_mesh("dp=2,tp=4"), ["S(0)", "S(1)"], color=False))
    print(show_param(plan, "blocks.0.mlp.w_in"))     # a parameter of a ShardingPlan
    print(show(dtensor))                              # any live DTensor in a run
    write_plan_html(plan, "plan.html")                # every parameter, one table per stage

DTensor semantics: a dim split over several mesh axes is split by the earlier mesh axis
first (outer, slower index), as ``ParamLayout.data_index`` nests dp then fsdp.
"""

from __future__ import annotations

import difflib
import html
import itertools
import math
import os
import re
import tempfile
from collections.abc import Callable, Sequence

from fxmega.core.errors import ConfigError
from fxmega.sharding.mesh import PHYSICAL_ORDER, MeshSpec
from fxmega.sharding.plan import ShardingPlan, format_bytes

_PLACEMENT = re.compile(r"S\((\d+)\)|R|P")
_ANSI = (153, 217, 186, 229, 183, 152, 223, 195, 218, 194, 189, 230, 159, 224, 157, 225)  # light backgrounds
Cell = tuple[list[int], str]  # ranks holding the block, and the mesh coordinates that pick it ("dp0 tp1")


class _View:
    """Axis names, sizes and the global rank at each mesh position (row-major): a MeshSpec
    or a torch DeviceMesh (whose ranks need not be 0..N-1, and whose names are free)."""

    def __init__(self, names: Sequence[str], sizes: Sequence[int], ranks: Sequence[int]):
        self.names, self.sizes, self.ranks = tuple(names), tuple(sizes), list(ranks)

    @staticmethod
    def of(mesh: MeshSpec) -> _View:
        return _View(mesh.names, mesh.shape, range(mesh.world_size))


def _parse(placements: Sequence[str], view: _View, ndim: int) -> list[int | None]:
    """The tensor dim each mesh axis splits (None: replicated or partial)."""
    if len(placements) != len(view.names):
        raise ConfigError(f"{len(placements)} placements {list(placements)} for a mesh with {len(view.names)} axes "
                          f"({', '.join(view.names) or 'none'}): give one of S(d), R or P per mesh axis, in that order")
    dims: list[int | None] = []
    for axis, p in zip(view.names, placements):
        m = _PLACEMENT.fullmatch(str(p).replace(" ", ""))
        if m is None:
            raise ConfigError(f"placement {p!r} on mesh axis {axis}: write S(d) (split along dim d), R (replicated) "
                              f"or P (partial sum)")
        if m.group(1) is not None and int(m.group(1)) >= ndim:
            raise ConfigError(f"placement {p} on mesh axis {axis} splits dim {m.group(1)}, but the tensor has "
                              f"{ndim} dim(s)" + (f" (0..{ndim - 1})" if ndim else " (a scalar cannot be split)"))
        dims.append(int(m.group(1)) if m.group(1) is not None else None)
    return dims


def _assign(shape: Sequence[int], view: _View, placements: Sequence[str],
            keep: Callable[[dict[str, int]], bool] | None = None) -> tuple[dict, dict, list[int]]:
    """Blocks -> ranks, blocks -> ((axis, dim, coord), ...) of the splitting axes, and splits per dim."""
    dims = _parse(placements, view, len(shape))
    blocks: dict[tuple[int, ...], list[int]] = {}
    tags: dict[tuple[int, ...], tuple[tuple[str, int, int], ...]] = {}
    for pos, coord in enumerate(itertools.product(*(range(n) for n in view.sizes))):
        if keep is not None and not keep(dict(zip(view.names, coord))):
            continue
        index = [0] * len(shape)
        for d, c, n in zip(dims, coord, view.sizes):
            if d is not None:
                index[d] = index[d] * n + c  # earlier mesh axis = outer index
        blocks.setdefault(tuple(index), []).append(view.ranks[pos])
        tags[tuple(index)] = tuple((a, d, c) for a, d, c in zip(view.names, dims, coord) if d is not None)
    splits = [math.prod(n for d, n in zip(dims, view.sizes) if d == k) for k in range(len(shape))]
    return {k: sorted(v) for k, v in sorted(blocks.items())}, tags, splits


def shard_blocks(shape: Sequence[int], mesh: MeshSpec, placements: Sequence[str]) -> dict[tuple[int, ...], list[int]]:
    """Block index per tensor dim -> the ranks holding that block (several ranks: replicas).

    Pure data, the core of every picture here, so layouts can be checked in tests without a
    process group. ``placements`` has one entry per mesh axis, in ``mesh.names`` order."""
    return _assign(shape, _View.of(mesh), placements)[0]


def _ranks(ranks: Sequence[int], elide: bool = True) -> str:
    """``[0, 4, 8, 12, 32]`` -> ``"0,4..12,32"``: arithmetic runs of three or more compressed
    (``a..b`` for consecutive ranks, ``a,a+s..b`` for stride s); with ``elide``, more than four
    runs are cut to the first three and the last plus the count, so a cell stays narrow."""
    parts, i = [], 0
    while i < len(ranks):
        j = i + 1
        if j + 1 < len(ranks) and ranks[j] - ranks[i] == ranks[j + 1] - ranks[j]:
            step = ranks[j] - ranks[i]
            while j + 1 < len(ranks) and ranks[j + 1] - ranks[j] == step:
                j += 1
            parts.append(f"{ranks[i]}..{ranks[j]}" if step == 1 else f"{ranks[i]},{ranks[i] + step}..{ranks[j]}")
            i = j + 1
        else:
            parts.append(str(ranks[i]))
            i += 1
    if elide and len(parts) > 4:
        return ",".join(parts[:3]) + ",…," + parts[-1] + f" ({len(ranks)})"
    return ",".join(parts)


class _Picture:
    """The cells of a picture (rows x cols of (ranks, coordinates)) and its header line."""

    def __init__(self, shape: Sequence[int], view: _View, placements: Sequence[str],
                 axes: Sequence[str] | None = None, keep: Callable[[dict[str, int]], bool] | None = None):
        shape = tuple(int(n) for n in shape)
        blocks, tags, splits = _assign(shape, view, placements, keep)
        split = [k for k, n in enumerate(splits) if n > 1]
        if not split:
            shown: tuple[int, ...] = ()
        elif len(shape) <= 2:
            shown = tuple(range(len(shape)))
        elif len(split) >= 2:
            shown = tuple(split[:2])
        else:  # the split dim beside the largest other one
            other = max((k for k in range(len(shape)) if k != split[0]), key=lambda k: (shape[k], -k))
            shown = tuple(sorted((split[0], other)))
        rd, cd = (shown[0] if len(shown) == 2 else None), (shown[-1] if shown else None)
        self.rows, self.cols = (splits[rd] if rd is not None else 1), (splits[cd] if cd is not None else 1)
        self.replicated = not shown
        self.total, self.partial = len(view.ranks), "P" in placements
        self.cells: list[list[Cell]] = []
        for i in range(self.rows):
            row = []
            for j in range(self.cols):
                mine = [b for b in blocks if (rd is None or b[rd] == i) and (cd is None or b[cd] == j)]
                coords = " ".join(f"{a}{c}" for a, d, c in tags[mine[0]] if d in shown) if mine else ""
                row.append((sorted(r for b in mine for r in blocks[b]), coords))
            self.cells.append(row)
        head = f"{list(shape)}" + (f" ({', '.join(axes)})" if axes else "")
        if len(shape) > 2 and shown:
            head += f": dims {' x '.join(map(str, shown))} shown"
        merged = [k for k in split if k not in shown]
        head += "  placements " + (" ".join(f"{a}={n}:{p}" for a, n, p in zip(view.names, view.sizes, placements))
                                   or "-")
        head += f"  block {[-(-n // s) for n, s in zip(shape, splits)]}" if split else ""
        head += f"  (dims {merged} also split; their blocks merged per cell)" if merged else ""
        head += "  (P: every rank holds a partial sum)" if self.partial else ""
        self.header = head

    def lines(self, cell: Cell, elide: bool = True) -> list[str]:
        ranks, coords = cell
        if self.replicated:
            whole = f"{'partial' if self.partial else 'replicated'} on all {len(ranks)} rank{'s' * (len(ranks) != 1)}"
            return [whole] + ([_ranks(ranks, elide)] if len(ranks) != self.total else [])
        return [_ranks(ranks, elide)] + ([coords] if coords else [])

    def text(self, color: bool, width: int) -> str:
        cells = [[self.lines(c) for c in row] for row in self.cells]
        inner = max(max(len(t) for row in cells for c in row for t in c) + 2, (width - 1) // self.cols - 1)
        height = max(len(c) for row in cells for c in row) + (2 if self.rows <= 4 else 0)
        rule = lambda a, b, c: a + b.join("─" * inner for _ in range(self.cols)) + c
        out = [self.header, rule("┌", "┬", "┐")]
        for i, row in enumerate(cells):
            for k in range(height):
                segs = []
                for j, lines in enumerate(row):
                    at = k - (height - len(lines)) // 2
                    seg = (lines[at] if 0 <= at < len(lines) else "").center(inner)
                    paint = _ANSI[(i * self.cols + j) % len(_ANSI)]
                    segs.append(f"\x1b[30;48;5;{paint}m{seg}\x1b[0m" if color else seg)
                out.append("│" + "│".join(segs) + "│")
            out.append(rule("├", "┼", "┤") if i < self.rows - 1 else rule("└", "┴", "┘"))
        return "\n".join(out)

    def svg(self, w: int = 240) -> str:
        h = min(160, max(40, 28 * self.rows))
        cw, ch = w / self.cols, h / self.rows
        out = [f'<svg class="shard" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
               f'viewBox="-1 -1 {w + 2} {h + 2}">']
        for i, row in enumerate(self.cells):
            for j, cell in enumerate(row):
                x, y, hue = j * cw, i * ch, (i * self.cols + j) * 137.508 % 360
                tip = html.escape(" ".join(self.lines(cell, elide=False)))
                out.append(f'<g><title>{tip}</title><rect x="{x:.1f}" y="{y:.1f}" width="{cw:.1f}" height="{ch:.1f}" '
                           f'fill="hsl({hue:.0f},65%,82%)" stroke="#333" stroke-width="1"/>')
                fit = [t for t in self.lines(cell) if len(t) * 5.6 <= cw - 4][: max(0, int((ch - 2) // 11))]
                for k, t in enumerate(fit):
                    ty = y + ch / 2 + (k - (len(fit) - 1) / 2) * 11 + 3.5
                    out.append(f'<text x="{x + cw / 2:.1f}" y="{ty:.1f}" font-size="9.5" text-anchor="middle" '
                               f'font-family="monospace">{html.escape(t)}</text>')
                out.append("</g>")
        return "".join(out) + "</svg>"


def grid(shape: Sequence[int], mesh: MeshSpec, placements: Sequence[str], color: bool = True, width: int = 60,
         axes: Sequence[str] | None = None) -> str:
    """A terminal picture: the tensor as a rectangle cut into its blocks (rows: splits of the
    first shown dim, columns: of the second), each labelled with the ranks that hold it and the
    mesh coordinates that choose it. ``color`` paints each block (ANSI); ``axes`` names the dims."""
    return _Picture(shape, _View.of(mesh), placements, axes).text(color, width)


def _layout(plan: ShardingPlan, path: str):
    if path not in plan.params:
        close = difflib.get_close_matches(path, list(plan.params), n=5, cutoff=0.4) or list(plan.params)[:5]
        raise ConfigError(f"no parameter {path!r} in the plan; close matches: {', '.join(close)}")
    return plan.params[path]


def _param_picture(plan: ShardingPlan, path: str, kind: str) -> _Picture:
    if kind not in ("param", "grad", "opt"):
        raise ConfigError(f"kind {kind!r}: use param, grad or opt")
    p, owners = _layout(plan, path), plan.pp_owners(path)
    keep = (lambda c: c.get("pp", 0) in owners) if plan.pipeline is not None else None
    return _Picture(p.shape, _View.of(plan.mesh), p.placement_names(kind, plan.mesh), p.axes, keep)


def show_param(plan: ShardingPlan, path: str, kind: str = "param", color: bool = True) -> str:
    """The grid of one parameter of a plan (``kind``: the stored parameter, its gradient or
    its optimizer state, which ZeRO may split differently), with its local shape and owners."""
    pic, p = _param_picture(plan, path, kind), plan.params[path]
    pic.header = f"{path} ({kind}) {pic.header}"
    held = {r for row in pic.cells for ranks, _ in row for r in ranks}
    where = (f"pp rank{'s' * (len(plan.pp_owners(path)) > 1)} {','.join(map(str, plan.pp_owners(path)))} "
             f"({len(held)} of {plan.mesh.world_size} ranks)" if plan.pipeline is not None
             else f"all {plan.mesh.world_size} ranks")
    return (pic.text(color, 60) + f"\nlogical axes ({', '.join(p.axes)}); local shape {list(p.local_shape(kind))} "
            f"per rank; held by {where}")


def show(t, color: bool = True, width: int = 60) -> str:
    """The grid of a live ``torch.distributed.tensor.DTensor`` (any mesh, any axis names), so
    a layout can be printed from inside a run."""
    import torch.distributed as dist
    from torch.distributed.tensor import Partial, Replicate, Shard

    mesh = t.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    placements = [f"S({p.dim})" if isinstance(p, Shard) else "P" if isinstance(p, Partial)
                  else "R" if isinstance(p, Replicate) else str(p) for p in t.placements]
    pic = _Picture(tuple(t.shape), _View(names, tuple(mesh.shape), mesh.mesh.flatten().tolist()), placements)
    pic.header = f"DTensor {pic.header}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    return pic.text(color, width) + f"\nlocal shape {list(t.to_local().shape)} on rank {rank}"


def _rank_table(mesh: MeshSpec) -> str:
    if not mesh.names:
        return "<p>single device</p>"
    *outer, last = mesh.names
    rows = ["<table class=\"ranks\"><tr><th>" + html.escape(" ".join(outer) or "-") + "</th>" +
            "".join(f"<th>{html.escape(last)}={c}</th>" for c in range(mesh.size(last))) + "</tr>"]
    for r0 in range(0, mesh.world_size, mesh.size(last)):
        c = mesh.coords(r0)
        label = " ".join(f"{a}={c[a]}" for a in outer)
        rows.append(f"<tr><th>{html.escape(label)}</th>" +
                    "".join(f"<td>{r}</td>" for r in range(r0, r0 + mesh.size(last))) + "</tr>")
    return "".join(rows) + "</table>"


def _param_row(plan: ShardingPlan, path: str) -> str:
    p, mesh = plan.params[path], plan.mesh
    pl = html.escape(" ".join(p.placement_names("param", mesh)) or "-")
    opt = html.escape(" ".join(p.placement_names("opt", mesh)))
    local = html.escape(str(list(p.local_shape("param"))))
    if opt and opt != pl:
        pl, local = f"{pl}<br>opt: {opt}", f"{local}<br>opt: {html.escape(str(list(p.local_shape('opt'))))}"
    nbytes = format_bytes(p.local_numel() * plan.param_bytes)
    cells = [html.escape(path), html.escape(str(list(p.shape))), html.escape("(" + ", ".join(p.axes) + ")"), pl,
             local, html.escape(nbytes), _param_picture(plan, path, "param").svg()]
    return '<tr class="param">' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


_CSS = ("body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin-bottom:1.5em}"
        "td,th{border:1px solid #bbb;padding:3px 6px;vertical-align:middle;text-align:left}"
        "td{font-family:monospace;font-size:12px}th{background:#eee}.ranks td{text-align:right}")


def plan_html(plan: ShardingPlan, title: str = "fxmega sharding plan") -> str:
    """One self-contained HTML page (inline CSS and SVG, no scripts or external assets) for a
    whole plan: mesh, strategy and rank layout, then one table per pipeline stage listing each
    parameter with its placements, local shape, bytes per rank and a picture of its blocks."""
    mesh, s, e = plan.mesh, plan.strategy, html.escape
    strategy = s.name + ("" if "zero" in s.name else f", zero {s.zero}")
    strategy += ", sequence parallel" * plan.sequence_parallel
    out = [f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{e(title)}</title><style>{_CSS}</style>"
           f"</head><body><h1>{e(title)}</h1>",
           f"<p>mesh: {e(mesh.describe())}; physical order {e(' > '.join(PHYSICAL_ORDER))} (tp varies fastest)</p>",
           f"<p>strategy: {e(strategy)}; "
           f"rules: {e(', '.join(f'{k} -> {v}' for k, v in s.rules.items()))}</p>"]
    out += [f"<p>note: {e(n)}</p>" for n in plan.notes]
    out.append(f"<h2>Rank layout</h2>{_rank_table(mesh)}")
    header = "".join(f"<th>{e(h)}</th>" for h in ("parameter", "global shape", "logical axes",
                                                  f"placements ({','.join(mesh.names) or '-'})", "local shape",
                                                  "bytes/rank", "blocks on the mesh"))
    if plan.pipeline is None:
        groups = [("Parameters", list(plan.params))]
    else:
        groups = []
        for st in plan.pipeline.stages:
            mine = [path for path in plan.params if (path.split(".")[0] == "blocks" and
                                                     int(path.split(".")[1]) in st.blocks)
                    or (st.embed and path.split(".")[0] in plan.embed_groups)
                    or (st.head and path.split(".")[0] in plan.head_groups)]
            groups.append((f"Stage {st.index} on pp rank {st.rank}: {st.describe()}", mine))
    for name, paths in groups:
        out.append(f"<h2>{e(name)}</h2><table class=\"params\"><tr>{header}</tr>" +
                   "".join(_param_row(plan, p) for p in paths) + "</table>")
    for r in range(mesh.size("pp")):
        b = plan.bytes_per_rank(r)
        who = f"pp rank {r}" if plan.pipeline is not None else "per rank"
        out.append(f"<p>{who}: parameters {e(format_bytes(b['param']))}, gradients {e(format_bytes(b['grad']))}, "
                   f"AdamW state {e(format_bytes(b['opt']))} (fp32)</p>")
    return "".join(out) + "</body></html>\n"


def write_plan_html(plan: ShardingPlan, path: str | os.PathLike, title: str = "fxmega sharding plan") -> None:
    """Write ``plan_html`` to ``path`` atomically (a temporary file in the same folder, then
    ``os.replace``), so a browser or a watcher never sees half a page."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".plan-", suffix=".html.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(plan_html(plan, title))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
