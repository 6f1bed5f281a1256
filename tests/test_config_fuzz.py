"""config.json fuzz: every field the spec reads (and the rope settings inside it) replaced by values
of the wrong type or out of range. Each variant must end in one UnsupportedModelError line, or
give a spec the file reader takes (quantize never writes a spec it would refuse). In-process,
660 variants in about a second."""

import itertools
import json
from pathlib import Path

import pytest

from atomflow.errors import FormatError, UnsupportedModelError
from atomflow.model import filecheck, quantize_io
from atomflow.model.spec import CONFIG_TYPES, ModelSpec

BAD = [
    None,
    True,
    False,
    "x",
    "8",
    [],
    [1],
    {},
    {"a": 1},
    -1,
    0,
    1,
    3,
    1.5,
    1e-30,
    10**12,
    2**31,
    float("nan"),
    float("inf"),
    -0.0,
]


@pytest.fixture(scope="module")
def config(tiny_hf_dir):
    return json.loads((tiny_hf_dir / "config.json").read_text())


def _variants(config):
    for key in sorted(set(CONFIG_TYPES) | set(config)):
        for v in BAD:
            yield f"{key}={v!r}", {**config, key: v}
    for key, v in itertools.product(sorted(config["rope_scaling"]), BAD):
        yield f"rope_scaling.{key}={v!r}", {**config, "rope_scaling": {**config["rope_scaling"], key: v}}
    for v in BAD:
        yield f"config={v!r}", v


def test_config_fuzz(config):
    n = accepted = 0
    for name, cfg in _variants(config):
        n += 1
        try:
            spec = ModelSpec.from_hf_config(cfg)
            quantize_io.check_spec(Path("hf"), spec, {})  # what quantize checks next (no checkpoint here)
        except UnsupportedModelError as e:
            assert str(e).strip() and "\n" not in str(e), name
            continue
        except Exception as e:  # noqa: BLE001 - anything else is the bug this test looks for
            raise AssertionError(f"{name}: {type(e).__name__}: {e}") from None
        accepted += 1
        try:
            filecheck.spec_from_metadata("config", {"spec": spec.to_json()})
        except FormatError as e:
            raise AssertionError(f"{name}: quantize would write a spec the reader refuses: {e}") from None
    assert n > 500 and accepted < n
