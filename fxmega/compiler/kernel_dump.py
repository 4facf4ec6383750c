"""Kernel and graph dumps (``--dump-kernels DIR``): what every graph compiled inside
``dump_kernels`` became, and which source ops each kernel fuses.

    with dump_kernels("dumps", rank=par.rank, group_labels=par.groups.labels):
        run.do_step()          # compiles here

writes ``dumps/index.md`` (links to the ranks) and, per rank, ``dumps/rank{r}/``:
``index.json`` and ``index.md`` (per graph: its kind, FX node count, the kernels in
execution order with the ATen ops each fuses, the collectives with their mesh axis) and
``graph{N}/`` in compile order with ``fx_graph.py`` (the post-grad FX graph, or the
AOTAutograd graph under ``train.compile_backend=aot_eager``) and, for inductor,
``output_code.py`` (its generated module: C++ kernels on CPU, Triton on GPU).

How inductor is observed (torch 2.13): ``GraphLowering.save_output_code``, the hook
``torch._inductor.utils.run_and_get_code`` uses, receives each generated module while
``V.graph`` is still the ``GraphLowering`` that made it (its post-grad graph, forward /
backward flags); ``trace.provenance_tracking_level`` makes inductor record which post-grad
nodes each kernel was built from (the only per-kernel source record C++ kernels get: only
Triton and extern calls carry ``# Topologically Sorted Source Nodes`` comments) and mark
each call with a ``# [Provenance debug handles] name:N`` line.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fxmega.compiler.generated_code import kernels_before_waits
from fxmega.compiler.inspect import _GRAPH_HOOKS, Collective, collectives_in

KINDS = {"cpp": "fused C++", "triton": "Triton", "extern": "extern", "aten": "aten fallback", "op": "custom op",
         "collective": "collective", "wait": "wait"}
NO_KERNELS = "no kernels: aot_eager runs ops one by one"


@dataclass
class Kernel:
    name: str  # cpp_fused_add_0, triton_poi_fused_add_0, extern_kernels.mm, torch.ops.aten.x.default
    kind: str  # a key of KINDS
    source_nodes: list[str] = field(default_factory=list)  # from inductor's comment (Triton, extern)
    aten: list[str] = field(default_factory=list)  # "Original ATen" from the same comment
    handle: str | None = None  # "name:N", the key of inductor's provenance record
    fuses: list[str] = field(default_factory=list)  # ATen ops of the post-grad nodes it was built from
    group: str | None = None  # a collective's process-group name, as the call passes it


_DEF = re.compile(r"^(\w+) = async_compile\.(\w+)\(", re.M)
_STRINGS = re.compile(r"'''.*?'''|\"\"\".*?\"\"\"", re.S)
_ORIGIN = re.compile(r"#\s*(?:Topologically Sorted|Unsorted) Source Nodes: \[(.*)\], Original ATen: \[(.*)\]")
_HANDLE = re.compile(r"#\s*\[Provenance debug handles\] (\S+:\d+)\s*$")
_GROUP = re.compile(r"'([^']*)'\)\s*$")
_CALL = re.compile(r"^\s*(?:[\w\[\], ]+=\s*)?(extern_kernels\.\w+|torch\.ops\.\w+\.\w+\.\w+|aten\.\w+\.\w+|\w+)"
                   r"(?:\.run)?\(")


def _split(names: str) -> list[str]:
    return [n.strip() for n in names.split(",") if n.strip()]


def parse_output_code(text: str) -> list[Kernel]:
    """The kernel calls of an inductor output module, in execution order: fused kernels it
    defines (``async_compile.cpp_pybinding``/``triton``), ``extern_kernels.*``, ATen
    fallbacks, custom ops and ``_c10d_functional`` collectives and waits, each with the
    source nodes and ATen ops of the comment inductor writes above the call, if any."""
    defined = {name: ("cpp" if how.startswith("cpp") else how) for name, how in _DEF.findall(text)}
    kernels: list[Kernel] = []
    origin: tuple[list[str], list[str]] = ([], [])
    handle = None
    for line in _STRINGS.sub("''", text).splitlines():
        if (m := _ORIGIN.search(line)) and line.lstrip().startswith("#"):
            origin = (_split(m[1]), _split(m[2]))
            continue
        if m := _HANDLE.search(line):
            handle = m[1]
            continue
        m = _CALL.match(line)
        name = m[1] if m else ""
        if name.startswith("aten."):
            name = "torch.ops." + name
        if name in defined:
            kind = defined[name]
        elif name.startswith("extern_kernels."):
            kind = "extern"
        elif name.startswith("torch.ops."):
            ns = name.split(".")[2]
            kind = ("wait" if "wait_tensor" in name else "collective") if ns == "_c10d_functional" else \
                "aten" if ns == "aten" else "op"
        else:
            if not line.lstrip().startswith("#"):
                origin, handle = ([], []), None  # a comment belongs to the call right below it
            continue
        group = m[1] if kind == "collective" and (m := _GROUP.search(line)) else None
        kernels.append(Kernel(name, kind, origin[0], origin[1], handle, group=group))
        origin, handle = ([], []), None
    return kernels


@dataclass
class GraphDump:
    number: int
    backend: str  # inductor / aot_eager
    kind: str  # joint (forward+backward+optimizer) / forward / backward / inference / unknown
    fx_nodes: int
    files: dict[str, str]
    kernels: list[Kernel]
    collectives: list[Collective]
    code_collectives: int | None  # collective calls in the output code
    note: str = ""
    # per collective call of the output code, in issue order: its op and the compute kernels
    # between its start and its wait (inductor's final order; 0: exposed)
    code_hidden: list[tuple[str, int]] | None = None


def _op_name(node: torch.fx.Node) -> str:
    t = node.target
    packet = getattr(t, "_overloadpacket", None)
    return str(packet) if packet is not None else getattr(t, "__name__", str(t))


def graph_kind(graph: torch.fx.Graph, is_inference: bool | None = None, is_backward: bool | None = None) -> str:
    """What a compiled graph computes. fxmega's train step differentiates inside the compiled
    function, so AOTAutograd sees no output that needs a gradient and compiles an *inference*
    graph that holds the forward, the backward and the optimizer: called ``joint`` here when
    it contains backward ops."""
    if is_backward or any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
        return "backward"
    if is_inference is False:
        return "forward"
    if any(n.op == "call_function" and _op_name(n).endswith("_backward") for n in graph.nodes):
        return "joint (forward+backward+optimizer)"
    return "inference" if is_inference else "forward or inference"


def _readable(graph: torch.fx.Graph) -> str:
    gm = graph.owning_module
    if gm is not None:
        return gm.print_readable(print_output=False, include_stride=True, include_device=True)
    return graph.python_code("self").src


def _with_sources(kernels: list[Kernel], provenance: dict[str, list[str]], graph: torch.fx.Graph) -> None:
    order = {n.name: (i, n) for i, n in enumerate(graph.nodes)}
    for k in kernels:
        nodes = sorted((order[name] for name in provenance.get(k.handle or "", ()) if name in order),
                       key=lambda p: p[0])
        ops = [_op_name(n) for _, n in nodes if n.op == "call_function"]
        op = ".".join(k.name.split(".")[2:4]) if k.name.startswith("torch.ops.") else None
        k.fuses = list(dict.fromkeys(ops)) or list(k.aten) or ([op] if op else [])


@contextlib.contextmanager
def dump_kernels(directory: str | Path, rank: int = 0,
                 group_labels: dict[str, str] | Callable[[], dict[str, str]] | None = None,
                 ) -> Iterator[list[GraphDump]]:
    """Dump every graph compiled inside the block under ``directory/rank{rank}/``; the
    indexes are written on exit, when ``group_labels`` (process-group name -> mesh axes, or
    a function returning it, e.g. ``ProcessGroups.labels``: groups are made lazily) is
    read. Yields the list of ``GraphDump`` it fills."""
    import torch._inductor.debug as inductor_debug
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    out = Path(directory) / f"rank{rank}"
    out.mkdir(parents=True, exist_ok=True)
    dumps: list[GraphDump] = []

    def write(backend: str, kind: str, graph: torch.fx.Graph | None, code: str | None) -> GraphDump:
        n = len(dumps)
        gdir = out / f"graph{n}"
        gdir.mkdir(exist_ok=True)
        files = {}
        if graph is not None:
            (gdir / "fx_graph.py").write_text(_readable(graph))
            files["fx_graph"] = f"graph{n}/fx_graph.py"
        if code is not None:
            (gdir / "output_code.py").write_text(code)
            files["output_code"] = f"graph{n}/output_code.py"
        kernels = parse_output_code(code) if code is not None else []
        dump = GraphDump(n, backend, kind, len(graph.nodes) if graph is not None else 0, files, kernels,
                         collectives_in(graph) if graph is not None else [],
                         sum(k.kind == "collective" for k in kernels) if code is not None else None,
                         code_hidden=kernels_before_waits(code) if code is not None else None)
        dumps.append(dump)
        return dump

    def on_output_code(code: str) -> None:
        if previous is not None:
            previous(code)
        lowering = V.graph
        if not isinstance(lowering, GraphLowering):  # a cache hit or an out-of-process compile
            write("inductor", "unknown", None, code).note = "the code alone: inductor did not lower it here"
            return
        graph = lowering.orig_gm.graph  # the post-grad graph this code was generated from
        dump = write("inductor", graph_kind(graph, lowering.is_inference, lowering.is_backward), graph, code)
        _with_sources(dump.kernels, inductor_debug._inductor_triton_kernel_to_post_grad_node_info, graph)

    def on_aot_eager(graph: torch.fx.Graph) -> None:
        write("aot_eager", graph_kind(graph), graph, None).note = NO_KERNELS

    previous = GraphLowering.save_output_code
    GraphLowering.save_output_code = on_output_code
    _GRAPH_HOOKS.append(on_aot_eager)
    try:
        # The FX graph cache is off in the block: a cache hit would hand back the code
        # without lowering, so without the post-grad graph and the provenance record (and
        # with those of another process's graph if the cache were shared).
        with torch._inductor.config.patch({"fx_graph_cache": False, "trace.provenance_tracking_level": 2}):
            yield dumps
    finally:
        GraphLowering.save_output_code = previous
        _GRAPH_HOOKS.remove(on_aot_eager)
        labels = (group_labels() if callable(group_labels) else group_labels) or {}
        write_indexes(Path(directory), rank, dumps, labels)


def _collective_row(c: Collective, labels: dict[str, str]) -> dict:
    return {"op": c.op, "shape": list(c.shape), "itemsize": c.itemsize, "bytes": c.bytes, "group": c.group,
            "group_size": c.group_size, "axis": labels.get(c.group, c.group), "ops_before_wait": c.ops_between,
            "gflop_before_wait": c.flops_between / 1e9}


def write_indexes(directory: Path, rank: int, dumps: list[GraphDump], labels: dict[str, str]) -> None:
    """``rank{rank}/index.json`` and ``index.md``, and the top-level ``index.md``."""
    out = directory / f"rank{rank}"
    graphs = [{**{k: v for k, v in asdict(d).items() if k not in ("kernels", "collectives")},
               "kernels": [{**asdict(k), "axis": labels.get(k.group, k.group) if k.group else None}
                           for k in d.kernels],
               "collectives": [_collective_row(c, labels) for c in d.collectives]} for d in dumps]
    (out / "index.json").write_text(json.dumps({"rank": rank, "graphs": graphs}, indent=1))
    lines = [f"# Compiled graphs of rank {rank}", "",
             "Graphs in compile order. Kernels in execution order, with the ATen ops of the post-grad nodes "
             "each was built from; collectives as the FX graph issues them, with the mesh axes of their group.", ""]
    for g in graphs:
        links = " · ".join(f"[{name}]({path})" for name, path in g["files"].items())
        lines += [f"## graph {g['number']} · {g['kind']} · {g['backend']}", "",
                  f"{g['fx_nodes']} FX nodes · {links} · {len(g['kernels'])} kernel calls · "
                  f"{len(g['collectives'])} collectives", ""]
        if g["note"]:
            lines += [g["note"], ""]
        if g["kernels"]:
            lines += ["| # | kernel | kind | fuses |", "|---|---|---|---|"]
            lines += [f"| {i} | `{k['name']}` | {KINDS.get(k['kind'], k['kind'])}"
                      + (f" on {k['axis']}" if k["axis"] else "") + f" | {', '.join(k['fuses'])} |"
                      for i, k in enumerate(g["kernels"])]
            lines.append("")
        if g["collectives"]:
            calls = g["code_collectives"]
            lines += ["Collectives in FX-graph order" + (f" (the output code calls {calls})" if calls is not None
                                                       else "") + ":", "",
                      "| # | collective | input shape | bytes/elem | bytes | group | mesh axes | compute ops before "
                      "its wait | GFLOP before its wait |",
                      "|---|---|---|---|---|---|---|---|---|"]
            lines += [f"| {i} | {c['op']} | {tuple(c['shape'])} | {c['itemsize']} | {c['bytes']} | {c['group']} | "
                      f"{c['axis']} | {c['ops_before_wait']} | {c['gflop_before_wait']:.3g} |"
                      for i, c in enumerate(g["collectives"])]
            lines.append("")
        if g["code_hidden"]:
            exposed = sum(n == 0 for _, n in g["code_hidden"])
            lines += [f"In the output code (inductor's final order), {exposed} of {len(g['code_hidden'])} collective "
                      f"calls have no kernel between their start and their wait:", "",
                      "| # | collective call | kernels before its wait |", "|---|---|---|"]
            lines += [f"| {i} | {op} | {n} |" for i, (op, n) in enumerate(g["code_hidden"])]
            lines.append("")
    (out / "index.md").write_text("\n".join(lines))
    # the ranks dumped so far (each rank rewrites the list; the last one to finish lists all)
    ranks = sorted({rank} | {int(p.name[4:]) for p in directory.glob("rank*") if p.name[4:].isdigit()})
    top = ["# Kernel dumps", ""] + [f"- [rank {r}](rank{r}/index.md)" for r in ranks]
    tmp = directory / f".index.md.{rank}"
    tmp.write_text("\n".join(top) + "\n")
    tmp.replace(directory / "index.md")  # every rank writes the same list; the replace is atomic
