"""Notebook 06: write a scheduling policy (a :class:`~cbteach.core.policies.WaitingQueue`) and prove it safe.

The check runs the learner's policy inside the real :class:`~cbteach.Engine` on a few small
workloads -- one batch slot, three slots with a token budget (chunked prefill), and a KV pool so
small that requests are preempted, once with recompute and once with swap -- and checks, in this
order:

1. the policy runs: its ``key`` returns something comparable, its ``pick_victim`` returns one of
   the running requests it was given;
2. every request finishes, with exactly its forced number of tokens (``ignore_eos``);
3. every output equals a policy-free first-come-first-served engine's output (a policy decides
   *when* a request runs, never *what* it produces);
4. no KV block is leaked (the pool is whole again at the end, nothing left swapped out);
5. no step feeds more tokens than the token budget;
6. the property the policy claims, on the workloads where nobody is preempted and everyone
   arrives together: ``"shortest-prompt-first"`` admits requests in order of prompt length (equal
   lengths in arrival order), ``"fcfs"`` in arrival order, ``"priority"`` by priority then arrival.

The first broken invariant is reported with a hint; the answer is never printed.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.engine import Engine
from ..core.policies import WaitingQueue, make_queue
from ..core.request import Request
from . import report, self_check

CLAIMS = ("shortest-prompt-first", "fcfs", "priority")
MAX_STEPS = 2000

# Prompt lengths in arrival order (ties on purpose: 3 and 3, 9 and 9), and priorities for "priority".
LENGTHS = [9, 3, 12, 3, 6, 1, 9]
PRIORITIES = [1, 2, 0, 1, 0, 2, 1]


@dataclass
class Workload:
    name: str
    max_batch_size: int
    max_new_tokens: int
    block_size: int = 4
    num_blocks: int | None = None  # None: plenty
    token_budget: int | None = None
    preemption: str = "recompute"
    claim_holds: bool = True  # nobody is preempted here, so admissions follow the policy's order alone


WORKLOADS = [
    Workload("one batch slot, everyone arrives together", 1, 3),
    Workload("three slots and a token budget of 8 (chunked prefill)", 3, 5, token_budget=8),
    Workload("a tight KV pool of 14 blocks of 4 tokens (recompute preemption)", 4, 14, num_blocks=14,
             claim_holds=False),
    Workload("a tight KV pool of 14 blocks of 4 tokens (swap preemption)", 4, 14, num_blocks=14,
             preemption="swap", claim_holds=False),
]


class PolicyError(Exception):
    """The learner's policy broke its contract (raised from inside the engine, reported as a hint)."""


def prompts(vocab_size: int) -> list[list[int]]:
    """Deterministic token-id prompts of :data:`LENGTHS` (ids 3.. kept clear of special tokens)."""
    span = max(1, min(vocab_size, 97) - 3)
    return [[3 + (11 * i + 7 * j + 5) % span for j in range(n)] for i, n in enumerate(LENGTHS)]


def requests(model, max_new_tokens: int) -> list[Request]:
    return [Request(p, max_new_tokens, request_id=f"r{i}", priority=PRIORITIES[i], ignore_eos=True)
            for i, p in enumerate(prompts(model.config.vocab_size))]


def reference_outputs(model, max_new_tokens: int) -> dict:
    """What a plain FCFS engine with room for everyone (concatenating cache, no pool) produces."""
    reqs = requests(model, max_new_tokens)
    done = Engine(model, None, max_batch_size=len(reqs)).run(reqs)
    return {c.request_id: c.output_ids for c in done}


def _factory(policy):
    """A function that makes a fresh queue of the learner's policy for each engine."""
    if isinstance(policy, WaitingQueue):
        return lambda: type(policy)()
    if isinstance(policy, type) and issubclass(policy, WaitingQueue):
        return policy
    if isinstance(policy, str):
        make_queue(policy)  # raises ValueError for an unknown name
        return lambda: make_queue(policy)
    return None


def _watched(queue: WaitingQueue) -> WaitingQueue:
    """Wrap the queue's ``key`` and ``pick_victim`` so a broken one is caught where it happens."""
    key, pick = queue.key, queue.pick_victim

    def checked_key(seq):
        try:
            k = key(seq)
        except NotImplementedError:
            raise PolicyError("your class has no key(): define key(self, seq), which returns what the waiting "
                              "queue sorts by (smaller is admitted first)") from None
        except Exception as err:
            raise PolicyError(f"key({seq.request_id!r}) raised {type(err).__name__}: {err}") from None
        if k is None:
            raise PolicyError(f"key({seq.request_id!r}) returned None: did you forget a `return`?")
        return k

    def checked_pick(running):
        offered = list(running)
        try:
            victim = pick(running)
        except Exception as err:
            raise PolicyError(f"pick_victim raised {type(err).__name__}: {err}") from None
        if not any(victim is s for s in offered):
            what = getattr(victim, "request_id", victim)
            raise PolicyError(f"pick_victim returned {what!r}, which is not one of the running requests it was "
                              f"given ({[s.request_id for s in offered]}): the victim must come from `running`")
        return victim

    queue.key = checked_key
    queue.pick_victim = checked_pick
    return queue


def run_workload(make, model, w: Workload):
    """Run the seven requests of :func:`requests` under workload ``w`` with a queue from ``make()``.
    Returns ``(engine, records)``; raises :class:`PolicyError` when the policy breaks its contract."""
    kw = {} if w.num_blocks is None else {"num_blocks": w.num_blocks}
    try:
        queue = make()
    except Exception as err:
        raise PolicyError(f"your policy could not be created without arguments: {type(err).__name__}: {err}") \
            from None
    if not isinstance(queue, WaitingQueue):
        raise PolicyError(f"a policy is a subclass of cbteach.core.policies.WaitingQueue; got {type(queue).__name__}")
    eng = Engine(model, None, max_batch_size=w.max_batch_size, kv="paged", block_size=w.block_size,
                 token_budget=w.token_budget, policy=_watched(queue), preemption=w.preemption, **kw)
    try:
        for r in requests(model, w.max_new_tokens):
            eng.add_request(r)
        records = []
        while eng.has_unfinished() and len(records) < MAX_STEPS:
            rec = eng.step()
            if rec.seqs:
                records.append(rec)
    except PolicyError:
        raise
    except Exception as err:  # the engine tripped over something the policy did
        raise PolicyError(f"the engine failed with {type(err).__name__}: {err}") from None
    return eng, records


def _admissions(records) -> list:
    return [rid for rec in records for rid in rec.admitted]


def expected_order(claim: str, reqs) -> list:
    """The admission order ``claim`` promises when everyone arrives together (ties: arrival order)."""
    index = {r.request_id: i for i, r in enumerate(reqs)}
    if claim == "shortest-prompt-first":
        sort_key = lambda r: (len(r.prompt), index[r.request_id])
    elif claim == "priority":
        sort_key = lambda r: (r.priority, index[r.request_id])
    else:
        sort_key = lambda r: index[r.request_id]
    return [r.request_id for r in sorted(reqs, key=sort_key)]


def _claim_hint(claim, reqs, got, expected) -> str:
    by_id = {r.request_id: r for r in reqs}
    arrival = [r.request_id for r in reqs]
    if claim == "shortest-prompt-first":
        lengths = [len(by_id[rid].prompt) for rid in got]
        shown = f"the prompt lengths, in the order admitted, were {lengths}"
        if got == arrival:
            return f"{shown}: that is arrival order -- your key does not depend on the prompt's length"
        if lengths == sorted(lengths, reverse=True):
            return (f"{shown}: longest first. The queue admits the *smallest* key first, so your key grows "
                    "the wrong way")
        if lengths == sorted(lengths):
            return (f"{shown}: sorted, but prompts of equal length were not admitted in arrival order (ids "
                    f"{got}); among equals, the request that came first should go first")
        return f"{shown}: a shortest-prompt-first policy admits them in non-decreasing length"
    if claim == "priority":
        prios = [by_id[rid].priority for rid in got]
        shown = f"the priorities, in the order admitted, were {prios}"
        if got == arrival:
            return f"{shown}: that is arrival order -- your key ignores Request.priority"
        if prios == sorted(prios, reverse=True):
            return f"{shown}: least urgent first. Smaller priority = more urgent, and the smallest key goes first"
        if prios == sorted(prios):
            return (f"{shown}: sorted, but equal priorities were not admitted in arrival order (ids {got}); "
                    "among equals, the request that came first should go first")
        return f"{shown}: a priority policy admits them in non-decreasing priority"
    if got == list(reversed(arrival)):
        return ("they were admitted last in, first out; the queue admits the smallest key first, so under "
                "FCFS the earliest arrival needs the smallest key")
    return f"they were admitted in the order {got}; first come, first served admits in the order requests arrived"


@self_check
def check_policy(policy, model, claim: str = "shortest-prompt-first") -> bool:
    """Run ``policy`` (a :class:`~cbteach.core.policies.WaitingQueue` subclass) in the real engine on
    :data:`WORKLOADS` and check the invariants and the ``claim`` (one of :data:`CLAIMS`).

    ``model`` is any causal LM the engine runs (the notebook's bierce); prompts are token ids, so no
    tokenizer is needed, and output lengths are forced so every run is deterministic.
    """
    if not isinstance(claim, str) or claim not in CLAIMS:
        return report(False, "", f"claim must be one of {CLAIMS}, got {claim!r}")
    make = _factory(policy)
    if make is None:
        return report(False, "", f"pass your policy class itself (a subclass of cbteach.core.policies.WaitingQueue); "
                                 f"got {type(policy).__name__}")
    references: dict = {}
    preempted = 0
    for w in WORKLOADS:
        if w.max_new_tokens not in references:
            references[w.max_new_tokens] = reference_outputs(model, w.max_new_tokens)
        ref = references[w.max_new_tokens]
        reqs = requests(model, w.max_new_tokens)
        try:
            eng, records = run_workload(make, model, w)
        except PolicyError as err:
            return report(False, "", f"on the workload '{w.name}': {err}")
        preempted += sum(len(r.preempted) for r in records)
        where = f"on the workload '{w.name}'"
        # 2. every request finished, with its forced length
        missing = [r.request_id for r in reqs if r.request_id not in eng.completions]
        if missing:
            stuck = len(records) >= MAX_STEPS
            return report(False, "", f"{where}, requests {missing} never finished " + (
                f"(still running after {MAX_STEPS} steps: are the same requests preempted over and over?)"
                if stuck else "(the engine ran out of work without them: did your queue lose a request it was "
                              "given? add() must keep every request, and remove() take out only the one "
                              "asked for)"))
        short = [c.request_id for c in eng.completions.values()
                 if len(c.output_ids) != w.max_new_tokens or c.finish_reason != "length"]
        if short:
            return report(False, "", f"{where}, requests {short} did not produce their {w.max_new_tokens} tokens")
        # 3. outputs equal a policy-free engine's
        wrong = [rid for rid, out in ref.items() if eng.completions[rid].output_ids != out]
        if wrong:
            return report(False, "", f"{where}, the output of {wrong} differs from a plain FCFS engine's: a "
                                     "policy may change when a request runs, never what it produces -- does your "
                                     "policy modify the requests or sequences it is given?")
        # 4. no KV block leaked
        mgr = eng.kv.manager
        if mgr.num_free_blocks != eng.kv.num_blocks or any(mgr.allocator.ref_counts) or eng.kv.swap_space:
            used = eng.kv.num_blocks - mgr.num_free_blocks
            return report(False, "", f"{where}, {used} KV block(s) are still in use after every request "
                                     f"finished ({len(eng.kv.swap_space)} request(s) still swapped out): did your "
                                     "queue keep a request that had already left?")
        # 5. the token budget
        if w.token_budget is not None:
            over = next((r for r in records if r.num_tokens > w.token_budget), None)
            if over is not None:
                return report(False, "", f"{where}, step {over.step} fed {over.num_tokens} tokens, over the "
                                         f"budget of {w.token_budget}")
        # 6. the claimed property
        if w.claim_holds:
            got, expected = _admissions(records), expected_order(claim, reqs)
            if got != expected:
                return report(False, "", f"{where}, the policy does not do what '{claim}' promises: "
                                         f"{_claim_hint(claim, reqs, got, expected)}")
    note = f", {preempted} preemptions survived" if preempted else ""
    return report(True, f"your policy is safe and keeps its promise ('{claim}') on all {len(WORKLOADS)} workloads: "
                        f"every request finished with the same tokens as plain FCFS, no KV block leaked, the "
                        f"token budget held{note}", "")
