"""Drafter config and checkpoint format: pure logic, no engine."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.config import TargetSpec, default_layers, load_drafter_config, validated
from kvshot_vllm.models.drafter import check_drafter_weights, expected_shapes
from kvshot_vllm.models.registry import choices_message
from kvshot_vllm.models.weights import init_weights, save_checkpoint

SMOL = TargetSpec(name="smol", hidden_size=576, vocab_size=49152, num_layers=30,
                  num_attention_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5,
                  rms_norm_eps=1e-5, intermediate_size=1536)


def test_defaults_follow_kvshot() -> None:
    cfg = validated({"paradigm": "kv", "target": SMOL})
    assert cfg.kv_layers == [0, 14, 29] == default_layers(30, 3)
    assert cfg.eagle_layers == 0 and not cfg.uses_aux_hidden
    hybrid = validated({"paradigm": "hybrid", "target": SMOL})
    assert hybrid.eagle_layers == 1 and hybrid.aux_layers == [2, 15, 27]
    assert validated({"paradigm": "hidden", "target": SMOL}).architecture == "Eagle3LlamaForCausalLM"
    # a view of its own cache is the plugin's to serve: stock EAGLE-3 would read all of it
    assert validated({"paradigm": "hidden", "target": SMOL, "kv_budget": {
        "tokens": 128, "block_size": 32, "draft_cache": True}}).architecture == "KVShotLlamaEagle3"
    # where EAGLE-3's default [2, L // 2, L - 3] repeats a layer, spaced layers instead
    for n in range(3, 12):
        aux = validated({"paradigm": "hidden", "target": SMOL.model_copy(
            update={"num_layers": n})}).aux_layers
        assert len(set(aux)) == 3 and aux == ([2, n // 2, n - 3] if n > 6 else aux), (n, aux)


@pytest.mark.parametrize("fields, message", [
    ({"paradigm": "kv", "kv_layers": [3, 30]}, "kv_layers [30] out of range for a target with 30 layers"),
    ({"paradigm": "hidden", "kv_layers": [1]}, "reads no target KV"),
    ({"paradigm": "mystery"}, f"paradigm: {choices_message()}"),
    ({"paradigm": "kv", "kv_layer_map": "aligned"}, "one kv_layer per drafter layer"),
    ({"paradigm": "kv", "draft_vocab_size": 60000}, "draft_vocab_size 60000"),
    ({"paradigm": "kv", "ssm_state_size": 8}, "the recurrent mixer belongs to block drafters"),
    ({"paradigm": "hidden", "aux_layers": [2, 3, 3]}, "aux_layers [2, 3, 3] repeat a layer"),
])
def test_bad_configs_name_the_problem(fields, message) -> None:
    with pytest.raises(KVShotError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validated({**fields, "target": SMOL})


def test_target_mismatch_names_each_field() -> None:
    other = SMOL.model_copy(update={"hidden_size": 960, "num_layers": 32, "name": "other"})
    problems = SMOL.mismatches(other)
    assert problems == ["hidden_size: drafter was trained for 576, target has 960",
                        "num_layers: drafter was trained for 30, target has 32"]


@pytest.mark.parametrize("paradigm,options", [("hidden", {}), ("kv", {}), ("hybrid", {}),
                                              ("block", {"ssm_state_size": 4})])
def test_checkpoint_round_trip(paradigm: str, options: dict, tmp_path: Path) -> None:
    cfg = validated({"paradigm": paradigm, "target": SMOL, "draft_vocab_size": 8000, **options})
    weights = init_weights(cfg, seed=1)
    out = save_checkpoint(cfg, weights, tmp_path / paradigm)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == [cfg.architecture] and raw["draft_vocab_size"] == 8000
    assert load_drafter_config(out) == cfg
    loaded = load_file(out / "model.safetensors")
    assert set(loaded) == set(expected_shapes(cfg))
    assert all((loaded[n].float() == w.float()).all() for n, w in weights.items())
    assert not (tmp_path / f"{paradigm}.partial").exists()


def test_missing_misshapen_or_unknown_weight() -> None:
    cfg = validated({"paradigm": "hybrid", "target": SMOL})
    weights = init_weights(cfg)
    del weights["merge.gate"]
    with pytest.raises(KVShotError, match="missing weight 'merge.gate'"):
        check_drafter_weights(cfg, weights)
    weights = init_weights(cfg)
    weights["cross.q_proj.weight"] = weights["cross.q_proj.weight"][:10]
    with pytest.raises(KVShotError, match="cross.q_proj.weight"):
        check_drafter_weights(cfg, weights)
    weights = init_weights(cfg) | {"cross2.q_proj.weight": weights["cross.q_proj.weight"]}
    with pytest.raises(KVShotError, match="'cross2.q_proj.weight', which no hybrid drafter owns"):
        check_drafter_weights(cfg, weights)


def test_not_a_kvshot_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(KVShotError, match="no 'kvshot' block"):
        load_drafter_config(tmp_path)


def model_imports(path: Path) -> set[str]:
    """The `kvshot_vllm.models` modules that `path` imports, at any depth (functions included),
    except under `if TYPE_CHECKING:`, which annotations read and the interpreter never runs."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvshot_vllm.models."):
            found.add(node.module.rsplit(".", 1)[1])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_model_modules_import_no_circle() -> None:
    """The model modules form a layering: no module imports (even lazily, inside a function)
    one that imports it back. The registry loads the paradigm modules by name
    (`importlib`), which is how they register, not an import of theirs."""
    root = Path(__file__).parents[1] / "kvshot_vllm" / "models"
    graph = {p.stem: model_imports(p) for p in root.glob("*.py")}
    assert graph["weights"] >= {"drafter", "files"}  # the walk sees what it should

    def circle(start: str, module: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
        for dep in sorted(graph.get(module, ())):
            if dep == start:
                return path
            if dep not in path:
                found = circle(start, dep, (*path, dep))
                if found:
                    return found
        return None

    circles = [c for m in graph if (c := circle(m, m, (m,)))]
    assert not circles, f"import circles among kvshot_vllm/models: {circles}"
