#!/usr/bin/env python3
"""Write each tiny fixture's config in the two styles checkpoints on the hub come in.

* config.json                as transformers 5 saves it: the rotary base in
                             `rope_parameters: {"rope_theta": ..., "rope_type": "default"}`, the
                             weights' dtype in `dtype`; no top-level `rope_theta`, `rope_scaling` or
                             `torch_dtype`.
* config.transformers4.json  the same model as transformers 4 saved it: top-level `rope_theta`,
                             `rope_scaling` (null, or the scaling's dict without its theta) and
                             `torch_dtype`; no `rope_parameters` or `dtype`. The YaRN fixture
                             names its type with the older key `type`, as some hub configs do.

Apart from those keys the two files are equal, and they describe the same model, so the
references (computed by make_fixtures.py from config.json) hold for both. The parity tests run
every fixture with each.

make_fixtures.py calls `write_config_styles` on each checkpoint it saves. Run alone, this needs
only python3: it rewrites both files of every tiny fixture from its current config.json, which
may be in either style or carry both at once.

    python3 tests/reference/fixture_configs.py
"""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
TINY_FIXTURES = [
    "tiny-qwen3",
    "tiny-qwen3-bf16",
    "tiny-llama",
    "tiny-qwen2",
    "tiny-mistral",
    "tiny-llama3",
    "tiny-qwen3-yarn",
]
# Fixtures whose transformers 4 config spells the rotary type `type` rather than `rope_type`.
LEGACY_TYPE_KEY = {"tiny-qwen3-yarn"}
TRANSFORMERS4_CONFIG = "config.transformers4.json"

# The keys in which the two styles differ; every other key is written to both files unchanged.
STYLE_KEYS = {"rope_parameters", "rope_theta", "rope_scaling", "dtype", "torch_dtype"}


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def the_one_value(stated: dict) -> object:
    """The value the keys in `stated` (name -> value, None when absent) agree on."""
    values = [v for v in stated.values() if v is not None]
    assert values and all(v == values[0] for v in values), f"expected one value among {stated}"
    return values[0]


def split_styles(cfg: dict, dtype: str | None = None, legacy_type_key: bool = False) -> tuple[dict, dict]:
    """(transformers 5 style, transformers 4 style) of a config in either style, or both.

    `dtype`, when given, is the weights' dtype to write (make_fixtures.py knows it); otherwise
    the config's own `dtype` / `torch_dtype` is kept.
    """
    rope = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    theta = the_one_value(
        {
            "rope_theta": cfg.get("rope_theta"),
            "rope_parameters.rope_theta": rope.get("rope_theta"),
            "rope_scaling.rope_theta": legacy.get("rope_theta"),
        }
    )
    # The scaling: every key of the rotary dicts but the theta, with its type under `rope_type`.
    scaling = {k: v for k, v in {**legacy, **rope}.items() if k != "rope_theta"}
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    scaling.setdefault("rope_type", "default")
    for field, stated in (("rope_parameters", rope), ("rope_scaling", legacy)):
        for key, value in stated.items():
            key = "rope_type" if key == "type" else key
            assert key == "rope_theta" or scaling[key] == value, f"{field}.{key} = {value} disagrees with {scaling}"
    if dtype is None:
        dtype = the_one_value({"dtype": cfg.get("dtype"), "torch_dtype": cfg.get("torch_dtype")})
    common = {k: v for k, v in cfg.items() if k not in STYLE_KEYS}
    transformers5 = {**common, "dtype": dtype, "rope_parameters": {"rope_theta": theta, **scaling}}
    if scaling["rope_type"] == "default":
        rope_scaling = None
    elif legacy_type_key:
        rope_scaling = {("type" if k == "rope_type" else k): v for k, v in scaling.items()}
    else:
        rope_scaling = scaling
    transformers4 = {**common, "torch_dtype": dtype, "rope_theta": theta, "rope_scaling": rope_scaling}
    return dict(sorted(transformers5.items())), dict(sorted(transformers4.items()))


def write_config_styles(checkpoint: Path, dtype: str | None = None) -> None:
    """Rewrites `checkpoint`/config.json in transformers 5 style and writes its transformers 4 twin."""
    cfg = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    transformers5, transformers4 = split_styles(cfg, dtype, checkpoint.name in LEGACY_TYPE_KEY)
    write_json(checkpoint / "config.json", transformers5)
    write_json(checkpoint / TRANSFORMERS4_CONFIG, transformers4)


def main() -> None:
    for name in TINY_FIXTURES:
        write_config_styles(FIXTURES / name)
        print(f"{name}: config.json (transformers 5), {TRANSFORMERS4_CONFIG} (transformers 4)")


if __name__ == "__main__":
    main()
