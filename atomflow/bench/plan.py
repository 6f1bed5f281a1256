"""`atomflow bench` options and the tests they ask for, checked before anything touches a GPU.

llama-bench's tests: pp<P> (prompt processing of P random tokens), tg<N> (N generated tokens
from an empty cache), and at each depth D of --context (llama-bench's -d) pp<P>@d<D> (P prompt tokens
after D cached ones: a later turn of a conversation) and tg<N>@d<D> (N tokens after the cache was filled
to depth D). -p, -n and --context take comma-separated lists; 0 in -p or -n skips that kind of test.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

BASELINES = ("hf", "torch-compile", "torch-compile-int8", "torch-fp8", "vllm")
FORMATS = ("md", "json", "csv")


@dataclass(frozen=True)
class BenchTest:
    kind: str  # "pp" or "tg"
    n_prompt: int  # pp: prompt tokens
    n_gen: int  # tg: generated tokens (TPOT from the n_gen - 1 gaps between them)
    depth: int = 0  # tokens in the cache before the prompt (pp) or the first generated one (tg)

    @property
    def name(self) -> str:
        at = f"@d{self.depth}" if self.depth else ""
        return f"pp{self.n_prompt}{at}" if self.kind == "pp" else f"tg{self.n_gen}{at}"

    @property
    def mean_context(self) -> float:
        """tg: tokens in the cache before a timed step, averaged over the timed steps (positions
        depth + 1 .. depth + n_gen - 1: the first token's step is not an interval)."""
        return self.depth + self.n_gen / 2

    @property
    def positions(self) -> int:
        """Cache rows the test needs (pp: its TTFT run generates one token after the prompt, and
        the engine wants a free row for it)."""
        return self.depth + (self.n_prompt + 1 if self.kind == "pp" else self.n_gen)


@dataclass(frozen=True)
class BenchOptions:
    model: str
    n_prompt: tuple[int, ...] = (512,)
    n_gen: tuple[int, ...] = (128,)
    contexts: tuple[int, ...] = ()
    repetitions: int = 5
    warmup: bool = True
    output: str = "md"
    baselines: tuple[str, ...] = ()
    hf_dir: str | None = None
    seed: int = 0
    compile_prefill: bool = True  # the torch-compile baselines' prefill under torch.compile (gpt-fast's --compile_prefill)
    speculate: str | None = None  # "ngram:K": tg tests also run with speculation (atomflow/speculate.py)
    prefill_fp8: bool = False  # pp tests also on an engine with the FP8 prefill recipe (engine "atomflow w8a8")
    tests: tuple[BenchTest, ...] = field(default=(), compare=False)

    @property
    def max_context(self) -> int:
        """The KV cache that holds every test."""
        return max(t.positions for t in self.tests)


def int_list(text: str, flag: str, minimum: int) -> tuple[int, ...]:
    """'512,1024' -> (512, 1024); every value an integer >= minimum."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            v = int(part)
        except ValueError:
            raise ValueError(f"{flag}: {part!r} is not an integer") from None
        if v < minimum:
            raise ValueError(f"{flag}: {v} must be >= {minimum}")
        out.append(v)
    return tuple(dict.fromkeys(out))  # drop repeats, keep order


def one_int(text: str, flag: str, minimum: int) -> int:
    values = int_list(text, flag, minimum)
    if len(values) != 1:
        raise ValueError(f"{flag}: one integer expected, got {text!r}")
    return values[0]


def make_options(
    model: str,
    n_prompt: str = "512",
    n_gen: str = "128",
    context: str | None = None,
    repetitions: str = "5",
    warmup: bool = True,
    output: str = "md",
    baselines: list[str] | None = None,
    hf_dir: str | None = None,
    seed: str = "0",
    compile_prefill: bool = True,
    speculate: str | None = None,
    prefill_fp8: bool = False,
) -> BenchOptions:
    """The command line's strings -> checked options and their tests. ValueError names the flag."""
    ps = int_list(n_prompt, "-p", 0)
    ns = int_list(n_gen, "-n", 0)
    if any(n == 1 for n in ns):
        raise ValueError("-n: 1 generated token has no time per output token; use 0 (skip) or >= 2")
    depths = int_list(context, "--context", 1) if context not in (None, "") else ()
    ps, ns = tuple(p for p in ps if p), tuple(n for n in ns if n)
    tests = [BenchTest("pp", p, 0) for p in ps] + [BenchTest("tg", 0, n) for n in ns]
    for d in depths:
        tests += [BenchTest("pp", p, 0, d) for p in ps] + [BenchTest("tg", 0, n, d) for n in ns]
    if not tests:
        raise ValueError("nothing to run: -p and -n are both 0")
    if output not in FORMATS:
        raise ValueError(f"-o: output format must be one of {', '.join(FORMATS)}, got {output!r}")
    names: list[str] = []
    for b in baselines or []:
        for name in BASELINES if b == "all" else (b,):
            if name not in BASELINES:
                raise ValueError(f"--baseline: unknown baseline {name!r} (known: {', '.join(BASELINES)}, all)")
            if name not in names:
                names.append(name)
    return BenchOptions(
        model=model,
        n_prompt=ps,
        n_gen=ns,
        contexts=depths,
        repetitions=one_int(repetitions, "-r", 1),
        warmup=warmup,
        output=output,
        baselines=tuple(names),
        hf_dir=hf_dir,
        seed=one_int(seed, "--seed", 0),
        compile_prefill=compile_prefill,
        speculate=_speculate(speculate, ns),
        prefill_fp8=bool(prefill_fp8),
        tests=tuple(tests),
    )


def _speculate(value: str | None, n_gen: tuple[int, ...]) -> str | None:
    from atomflow.speculate import parse_speculate

    spec = parse_speculate(value)
    if spec is not None and not n_gen:
        raise ValueError("--speculate needs generated tokens: -n must be >= 2")
    return str(spec) if spec else None


def check_fits_model(opts: BenchOptions, max_positions: int) -> None:
    """Every test's cache must fit the model's position range (GPU memory is checked at load)."""
    worst = max(opts.tests, key=lambda t: t.positions)
    if worst.positions > max_positions:
        raise ValueError(
            f"{worst.name} needs {worst.positions} positions; the model supports {max_positions} "
            f"(max_position_embeddings): lower --context, -p or -n"
        )


def prompt_ids(vocab: int, n: int, seed: int) -> np.ndarray:
    """A test's random token ids, the same for every engine: n ids in [0, vocab), int32."""
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)
