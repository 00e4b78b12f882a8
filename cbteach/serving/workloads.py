"""Benchmark workloads: seeded, offline, every prompt given as token ids.

A :class:`Workload` is a fixed list of requests -- prompts (token ids), output caps, whether EOS
is ignored, and optional arrival times -- plus the parameters that made it, so a benchmark can
print and store exactly what it ran. :meth:`Workload.requests` hands out fresh
:class:`~cbteach.Request` objects every time it is called (engines keep the requests they run).
Nothing is downloaded: prompts come from the Devil's Dictionary that ships with the package
(``cbteach/bierce/corpus.jsonl``), cut into token windows by the tokenizer passed in; any model
whose vocabulary is at least bierce's 2,048 ids can run them.

The workloads:

* :func:`headwords` -- ``"CYNIC, n."``-style prompts; the model writes the entry and stops at EOS
  (bierce's answers are long-tailed: a median of ~55 tokens, a few run into the cap).
* :func:`length_variance` -- Anyscale's experiment (Daniel et al., *How continuous batching
  enables 23x throughput in LLM inference*, 2023): the same prompts of a fixed length, output
  lengths drawn from an exponential distribution and **clipped at a cap**, EOS ignored so each
  request generates exactly its length. One seed gives the same draws for every cap, so raising
  the cap only lets the long draws through: the variance of the lengths grows with the cap
  (a cap far below the mean gives every request the same length). Anyscale used 1,000 prompts of
  512 tokens and caps of 32, 128, 512 and 1,536; the defaults here are scaled down for a CPU.
  :func:`length_variance_sweep` builds one workload per cap.
* :func:`with_poisson_arrivals` -- any workload with arrival times of a Poisson process at
  ``rate`` requests per second (exponential gaps; the first request arrives at 0), as vLLM's
  ``benchmark_serving`` sends them with ``--request-rate``; :func:`poisson_sweep` builds one
  workload per rate, all with the same prompts and the same unit gaps scaled by ``1 / rate``.
* :func:`chat` -- a synthetic chat-like mix, an **approximation** of ShareGPT's shape (the data
  set vLLM's paper and benchmarks use; not downloaded here): prompt and output lengths drawn from
  long-tailed log-normal distributions whose means keep ShareGPT's ratio (the vLLM paper, Fig. 11:
  a mean of 161 prompt and 338 output tokens) scaled down by ``scale``, clipped at ``max_prompt``
  / ``max_output``; EOS ignored so each output has its drawn length, as vLLM's benchmark does
  with ``--ignore-eos``. Real conversations also have multi-turn structure, shared system prompts
  and topic-dependent lengths; none of that is modelled.

``WORKLOADS`` maps the command line's ``--workload`` names to builders.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..bierce.corpus import headword_prompts, load_entries
from ..core.request import Request
from ..core.validation import check_positive_int

CORPUS_ENTRIES = 300  # entries tokenized for the prompt windows (~40k tokens with bierce's tokenizer)
SHAREGPT_MEAN_PROMPT = 161.31  # the vLLM paper (Kwon et al., SOSP'23), Figure 11(a)
SHAREGPT_MEAN_OUTPUT = 337.99


@dataclass(frozen=True)
class Workload:
    """A fixed list of requests, and how it was made.

    ``prompts[i]`` (token ids), ``max_new_tokens[i]`` and ``arrival_times[i]`` (seconds after the
    start of a run; ``None``: everything arrives at once) describe request ``i``; ``ignore_eos``
    applies to all. ``params`` are the generator's arguments (seed included).
    """

    name: str
    prompts: tuple
    max_new_tokens: tuple
    ignore_eos: bool = False
    arrival_times: tuple | None = None
    params: dict = field(default_factory=dict)
    description: str = ""

    def __post_init__(self):
        if len(self.prompts) != len(self.max_new_tokens):
            raise ValueError("one max_new_tokens per prompt")
        if self.arrival_times is not None and len(self.arrival_times) != len(self.prompts):
            raise ValueError("one arrival time per prompt")
        for m in self.max_new_tokens:
            check_positive_int("max_new_tokens", m)
        if any(len(p) == 0 for p in self.prompts):
            raise ValueError("every prompt needs at least one token")

    def __len__(self) -> int:
        return len(self.prompts)

    def requests(self) -> list[Request]:
        """Fresh requests ``r0, r1, ...`` (token-id prompts), in workload order."""
        times = self.arrival_times or (None,) * len(self)
        return [Request(list(p), int(m), request_id=f"r{i}", ignore_eos=self.ignore_eos,
                        arrival_time=None if t is None else float(t))
                for i, (p, m, t) in enumerate(zip(self.prompts, self.max_new_tokens, times))]

    __call__ = requests  # a workload is also a zero-argument request factory

    @property
    def prompt_lengths(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def output_lengths(self) -> list[int] | None:
        """The exact output lengths when EOS is ignored (each request makes ``max_new_tokens``), else None."""
        return list(self.max_new_tokens) if self.ignore_eos else None

    def head(self, n: int) -> "Workload":
        """The first ``n`` requests (a warm-up wave)."""
        _check_n(n)
        return replace(self, prompts=self.prompts[:n], max_new_tokens=self.max_new_tokens[:n],
                       arrival_times=None if self.arrival_times is None else self.arrival_times[:n])

    def summary(self) -> dict:
        """What a benchmark stores about the workload: sizes, length statistics, rate, parameters."""
        out = {"name": self.name, "description": self.description, "num_requests": len(self),
               "ignore_eos": self.ignore_eos, "prompt_len": length_stats(self.prompt_lengths),
               "max_new_tokens": length_stats(self.max_new_tokens), "params": dict(self.params)}
        if self.arrival_times is not None:
            span = max(self.arrival_times) - min(self.arrival_times)
            out["arrivals"] = {"span_s": span, "rate": self.params.get("rate"),
                               "observed_rate": (len(self) - 1) / span if span > 0 else None}
        return out


def length_stats(values) -> dict:
    """min, p50, mean, p90, max and standard deviation of a list of lengths."""
    a = np.asarray(list(values), dtype=float)
    if not a.size:
        return {"min": None, "p50": None, "mean": None, "p90": None, "max": None, "std": None}
    return {"min": int(a.min()), "p50": float(np.percentile(a, 50)), "mean": float(a.mean()),
            "p90": float(np.percentile(a, 90)), "max": int(a.max()), "std": float(a.std())}


# -- prompts from the corpus ----------------------------------------------------------------------
_STREAMS: dict = {}


def corpus_ids(tok) -> list[int]:
    """The first ``CORPUS_ENTRIES`` dictionary entries as one stream of token ids (cached per tokenizer)."""
    key = (getattr(tok, "name_or_path", None), len(tok), type(tok).__name__)
    if key not in _STREAMS:
        texts = [e["text"] + "\n\n" for e in load_entries()[:CORPUS_ENTRIES]]
        _STREAMS[key] = [t for ids in tok(texts, add_special_tokens=False)["input_ids"] for t in ids]
    return _STREAMS[key]


def corpus_windows(tok, lengths, rng) -> list[tuple]:
    """One window of the token stream per length, each at a random offset drawn from ``rng``."""
    stream = corpus_ids(tok)
    out = []
    for n in lengths:
        n = int(n)
        if not 1 <= n <= len(stream):
            raise ValueError(f"a prompt of {n} tokens does not fit in the corpus stream ({len(stream)} tokens)")
        start = int(rng.integers(0, len(stream) - n + 1))
        out.append(tuple(stream[start:start + n]))
    return out


def _check_n(n):
    check_positive_int("the number of requests", n)


def _check(name: str, value, low, integer: bool = False, strict: bool = True) -> None:
    """``value`` must be a number (an integer if ``integer``) above ``low`` (or at least ``low``)."""
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if not isinstance(value, kinds) or isinstance(value, bool) or not (value > low if strict else value >= low) \
            or not math.isfinite(value):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a finite number'} "
                         f"{'>' if strict else '>='} {low}, got {value!r}")


# -- the workloads -----------------------------------------------------------------------------------
def headwords(tok, n: int = 32, max_new_tokens: int = 128) -> Workload:
    """``n`` headword prompts spread over the dictionary; outputs end at EOS or ``max_new_tokens``."""
    _check_n(n)
    check_positive_int("max_new_tokens", max_new_tokens)
    prompts = tuple(tuple(tok(p)["input_ids"]) for p in headword_prompts(n))
    return Workload("headwords", prompts, (int(max_new_tokens),) * n, ignore_eos=False,
                    params={"n": n, "max_new_tokens": max_new_tokens},
                    description=f"{n} headword prompts; the model stops at EOS or after {max_new_tokens} tokens")


def exponential_lengths(n: int, mean: float, cap: int, seed: int = 0) -> list[int]:
    """``n`` output lengths: ``ceil`` of exponential draws of mean ``mean``, clipped to ``[1, cap]``.

    The draws depend on ``n``, ``mean`` and ``seed`` only, so the same seed with a larger cap keeps
    every length below the old cap and lets the long ones grow.
    """
    _check_n(n)
    draws = np.random.default_rng(seed).exponential(mean, n)
    return [int(min(cap, max(1, math.ceil(x)))) for x in draws]


def length_variance(tok, n: int = 32, cap: int = 64, mean: float = 48.0, prompt_len: int = 16,
                    seed: int = 0) -> Workload:
    """Anyscale's length-variance workload at one ``cap`` (see the module's docstring)."""
    _check_n(n)
    check_positive_int("cap", cap)
    _check("mean", mean, 0)
    check_positive_int("prompt_len", prompt_len)
    _check("seed", seed, 0, integer=True, strict=False)
    rng = np.random.default_rng([seed, 1])  # prompts: independent of the lengths' draws
    prompts = tuple(corpus_windows(tok, [prompt_len] * n, rng))
    lengths = tuple(exponential_lengths(n, mean, cap, seed))
    return Workload("length_variance", prompts, lengths, ignore_eos=True,
                    params={"n": n, "cap": cap, "mean": mean, "prompt_len": prompt_len, "seed": seed},
                    description=f"{n} prompts of {prompt_len} tokens; output lengths exponential (mean {mean:g}) "
                                f"clipped at {cap}, EOS ignored")


def length_variance_sweep(tok, n: int = 32, caps=(4, 16, 64, 192), **kw) -> list[Workload]:
    """One :func:`length_variance` workload per cap: same prompts, same draws, growing variance."""
    return [length_variance(tok, n, cap, **kw) for cap in caps]


def poisson_gaps(n: int, seed: int = 0) -> list[float]:
    """``n`` unit-rate exponential gaps; the first is 0 (the first request arrives at once)."""
    _check_n(n)
    gaps = np.random.default_rng([seed, 2]).exponential(1.0, n)
    gaps[0] = 0.0
    return [float(g) for g in gaps]


def with_poisson_arrivals(workload: Workload, rate: float, seed: int = 0) -> Workload:
    """``workload`` with Poisson arrivals at ``rate`` requests per second (``inf``: all at once)."""
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not rate > 0:
        raise ValueError(f"rate must be > 0 requests per second, got {rate!r}")
    _check("seed", seed, 0, integer=True, strict=False)
    times = None if math.isinf(rate) else tuple(float(t) for t in np.cumsum(poisson_gaps(len(workload), seed)) / rate)
    return replace(workload, name=f"poisson({workload.name})", arrival_times=times,
                   params={**workload.params, "rate": rate, "arrival_seed": seed},
                   description=f"{workload.description}; Poisson arrivals at {rate:g} requests/s")


def poisson_sweep(workload: Workload, rates, seed: int = 0) -> list[Workload]:
    """The same requests at each rate: one Poisson workload per rate (same gaps, scaled by 1 / rate)."""
    return [with_poisson_arrivals(workload, r, seed) for r in rates]


def lognormal_lengths(n: int, mean: float, sigma: float, lo: int, hi: int, rng) -> list[int]:
    """``n`` log-normal lengths of (unclipped) mean ``mean`` and shape ``sigma``, rounded, clipped to ``[lo, hi]``."""
    mu = math.log(mean) - sigma ** 2 / 2  # the log-normal's mean is exp(mu + sigma^2 / 2)
    return [int(min(hi, max(lo, round(x)))) for x in rng.lognormal(mu, sigma, n)]


def chat(tok, n: int = 32, scale: float = 0.125, sigma: float = 1.0, max_prompt: int = 128,
         max_output: int = 192, seed: int = 0) -> Workload:
    """The synthetic chat-like mix (an approximation of ShareGPT's shape; see the module's docstring)."""
    _check_n(n)
    _check("scale", scale, 0)
    _check("sigma", sigma, 0, strict=False)
    _check("max_prompt", max_prompt, 4, integer=True, strict=False)  # 4: the shortest prompt drawn
    check_positive_int("max_output", max_output)
    _check("seed", seed, 0, integer=True, strict=False)
    rng = np.random.default_rng([seed, 3])
    p_len = lognormal_lengths(n, SHAREGPT_MEAN_PROMPT * scale, sigma, 4, max_prompt, rng)
    o_len = lognormal_lengths(n, SHAREGPT_MEAN_OUTPUT * scale, sigma, 1, max_output, rng)
    prompts = tuple(corpus_windows(tok, p_len, rng))
    return Workload("chat", prompts, tuple(o_len), ignore_eos=True,
                    params={"n": n, "scale": scale, "sigma": sigma, "max_prompt": max_prompt,
                            "max_output": max_output, "seed": seed},
                    description=f"{n} chat-like requests (ShareGPT's shape x {scale:g}: log-normal prompt and output "
                                f"lengths, sigma {sigma:g}), EOS ignored")


def build(name: str, tok, n: int, *, max_new_tokens: int = 128, cap: int = 64, rate: float = 8.0,
          seed: int = 0) -> Workload:
    """A workload by its command-line name; ``poisson`` is headwords with Poisson arrivals at ``rate``."""
    if name == "headwords":
        return headwords(tok, n, max_new_tokens)
    if name == "length_variance":
        return length_variance(tok, n, cap, seed=seed)
    if name == "chat":
        return chat(tok, n, seed=seed)
    if name == "poisson":
        return with_poisson_arrivals(headwords(tok, n, max_new_tokens), rate, seed)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


WORKLOADS = ("headwords", "length_variance", "poisson", "chat")

# The command-line options each workload reads (``build``'s keywords); a command refuses the others rather than
# ignore them.
READ_BY = {"max_new_tokens": ("headwords", "poisson"), "cap": ("length_variance",), "rate": ("poisson",),
           "seed": ("length_variance", "poisson", "chat")}


def unread(name: str, given, sweep: bool = False) -> list[str]:
    """Of the options ``given`` (``build``'s keywords), those workload ``name`` would ignore: not its own, or the
    one a sweep sets at each point (``cap`` of length_variance, ``rate`` of poisson)."""
    swept = {"length_variance": "cap", "poisson": "rate"}.get(name) if sweep else None
    return [d for d in given if name not in READ_BY.get(d, (name,)) or d == swept]


def unread_error(name: str, wrong: list[str]) -> str:
    """The argument error for :func:`unread`'s options."""
    flag = lambda ds: ", ".join("--" + d.replace("_", "-") for d in ds)  # noqa: E731
    swept = [d for d in wrong if name in READ_BY[d]]  # (its own option, which a sweep sets)
    said = [f"--{d.replace('_', '-')} is read by {', '.join(READ_BY[d])} only" for d in wrong if d not in swept]
    said += [f"--sweep sets {flag(swept)} at each point"] if swept else []
    return f"--workload {name} would ignore {flag(wrong)} ({'; '.join(said)}): drop {'it' if len(wrong) == 1 else 'them'}"
