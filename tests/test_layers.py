"""The package's layers point one way: every fxmega module belongs to exactly one layer of
``LAYERS`` (lowest first), and imports only from its own layer or the ones below. A new module
must be placed here; a module that reaches up fails with the import that does it. Only
optional heavy dependencies may be imported inside functions."""

import ast
import graphlib
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

# lowest first: a module may import from its own layer and every layer above it in this list
LAYERS = {
    "core": "core core.errors core.spec core.tree core.json_files core.device core.memory core.precision core.log "
            "core.compute",
    "sharding annotations": "sharding sharding.layout sharding.mesh sharding.rules sharding.pipeline sharding.plan",
    "compiler": "compiler compiler.inspect compiler.generated_code compiler.kernel_dump compiler.overlap",
    "building blocks": "ops ops.kernels ops.kernels.triton_ops ops.kernels.triton_norms "
                       "ops.kernels.triton_cross_entropy ops.rope ops.attention_blocks ops.matmul ops.fp8 ops.layers "
                       "ops.losses "
                       "ops.objectives ops.recompute ops.counter_random ops.init ops.routing ops.experts ops.aux_loss "
                       "ops.moe ops.mtp ops.tied_embedding_grad ops.phases",
    "models": "models models.family models.bert models.gpt models.llama models.mixtral models.t5 models.pieces "
              "models.registry models.census models.checks models.classifier models.weight_uses models.deepseek_v3",
    "data": "data data.batches data.blend data.classification data.corpus data.gpt_dataset data.indexed data.mlm "
            "data.span_corruption data.parallel_text data.po_catalogues data.instructions data.code_corpus "
            "data.doc_questions "
            "data.preprocess data.sources data.tokenizer data.vocab_files data.prefetch",
    "config": "config",
    "optimizers": "optim optim.matrices optim.optimizer optim.adamw optim.muon",
    "distributed runtime": "parallel parallel.strategy parallel.collectives parallel.groups parallel.ring_attention "
                           "parallel.context parallel.activation_layouts parallel.param_shards parallel.flat_optimizer "
                           "parallel.grad_sync parallel.zero3 parallel.matrix_pieces parallel.runtime "
                           "parallel.distributed",
    "checkpoints and conversion": "storage storage.checkpoint_files storage.checkpoint storage.run_state "
                                  "storage.hf_files storage.hf_layout storage.hf_bert storage.hf_t5 storage.convert "
                                  "storage.pretrained "
                                  "storage.orbax_io",
    "inference": "inference inference.model_loader inference.generate inference.seq2seq "
                 "inference.generate_parallel inference.code_exec inference.scoring inference.stops",
    "training": "training training.optim training.update training.schedules training.metrics training.step "
                "training.pipeline_step training.evaluate training.faults training.heartbeat training.logs "
                "training.tracking training.state training.outcome training.checks training.interrupt "
                "training.reference training.run "
                "training.train "
                "training.finetune",
    "serving": "inference.serve_requests inference.serve inference.serve_mesh inference.generation_cli inference.chat "
               "inference.translation_eval inference.qa_eval inference.code_eval inference.harness",
    "planning": "planning planning.devices planning.estimate planning.traffic planning.visualize planning.fake "
                "planning.exposure planning.report planning.auto planning.summary planning.capacity",
    "command line": "cli cli.parser cli.launch cli.commands",
}
# imported inside functions because they are optional: the package imports without them
OPTIONAL_INSIDE_FUNCTIONS = {"fxmega.ops.kernels.triton_ops", "fxmega.ops.kernels.triton_norms",
                             "fxmega.ops.kernels.triton_cross_entropy"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "fxmega").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _level() -> dict[str, int]:
    return {f"fxmega.{m}": i for i, names in enumerate(LAYERS.values()) for m in names.split()}


def _imports(tree: ast.AST, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module) for every fxmega module a file imports, names imported from a package
    resolved to its submodules where they are ones."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "fxmega":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.append((node.lineno, sub if sub in modules else node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "fxmega"]
    return [(line, m) for line, m in out if m in modules]


def test_every_module_has_a_layer():
    level, modules = _level(), _modules()
    unplaced = sorted(m for m in modules if m != "fxmega" and m not in level)
    stale = sorted(m for m in level if m not in modules)
    assert not unplaced, f"place these modules in a layer of tests/test_layers.py: {unplaced}"
    assert not stale, f"tests/test_layers.py names modules that do not exist: {stale}"


def test_imports_point_down():
    level, modules, names = _level(), _modules(), list(LAYERS)
    upward = []
    for module, path in modules.items():
        if module == "fxmega":
            continue
        for line, target in _imports(ast.parse(path.read_text()), modules):
            if target != "fxmega" and level[target] > level[module]:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {module} ({names[level[module]]}) imports "
                              f"{target} ({names[level[target]]})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_folders_import_one_way():
    """Drawn as folders (core/, ops/, parallel/, ..., config.py on its own) and the imports
    between them, the package has no cycle: no two folders import each other, and none
    reaches back through a third."""
    modules, imports = _modules(), defaultdict(set)
    folder = lambda module: module.split(".")[1]  # noqa: E731
    for module, path in modules.items():
        if module == "fxmega":
            continue
        for _, target in _imports(ast.parse(path.read_text()), modules):
            if target != "fxmega" and folder(target) != folder(module):
                imports[folder(module)].add(folder(target))
    try:
        graphlib.TopologicalSorter(imports).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"folders that import each other, round: {' -> '.join(e.args[1])}") from None


def test_fxmega_modules_are_imported_at_module_level():
    modules, inside = _modules(), []
    for path in modules.values():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for line, target in _imports(fn, modules):
                    if target not in OPTIONAL_INSIDE_FUNCTIONS:
                        inside.append(f"{path.relative_to(ROOT)}:{line}: {target}")
    assert not inside, "fxmega modules imported inside functions (import them at the top):\n" + "\n".join(inside)


def test_architecture_doc_names_every_layer():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = {line.split("|")[1].strip() for line in doc.splitlines() if line.startswith("| ") and "---" not in line}
    assert set(LAYERS) <= rows, f"docs/architecture.md's layer table lacks {sorted(set(LAYERS) - rows)}"
