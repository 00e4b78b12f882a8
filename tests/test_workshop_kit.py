"""notebooks/WORKSHOP_KIT.md, the morning kit: linked from INSTRUCTOR.md, and every command, target and
figure it states that can be checked offline agrees with the code and the stored results."""
import json
import re
import sys
from pathlib import Path

from cbteach.__main__ import COMMANDS
from cbteach.student import SOLUTION_TAG
from cbteach.exercises.tournament_core import BASELINE, Trace

ROOT = Path(__file__).resolve().parents[1]
KIT = (ROOT / "notebooks" / "WORKSHOP_KIT.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    start = KIT.index(f"## {title}")
    end = KIT.find("\n## ", start + 1)
    return KIT[start:end if end > 0 else None]


def test_the_instructor_kit_links_the_morning_kit():
    assert "[WORKSHOP_KIT.md](WORKSHOP_KIT.md)" in (ROOT / "notebooks" / "INSTRUCTOR.md").read_text(encoding="utf-8")


def test_the_commands_and_targets_it_names_exist():
    makefile = (ROOT / "Makefile").read_text()
    for target in re.findall(r"`make ([\w-]+)`", KIT):
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"make {target} is not a target"
    for command in re.findall(r"python -m cbteach ([\w-]+)", KIT):
        assert command in COMMANDS, command
    for tool in re.findall(r"python (tools/[\w/]+\.py)", KIT):
        assert (ROOT / tool).exists(), tool
    for test in re.findall(r"`(tests/test_\w+\.py)`", KIT):
        assert (ROOT / test).exists(), test
    blocks = re.findall(r"```bash\n(.*?)```", section("1. The install sheet"), re.S)
    assert len(blocks) == 2  # the install, then opening the course: neither needs make (Windows has none)
    assert not [ln for b in blocks for ln in b.splitlines() if ln.split("#")[0].strip().startswith("make")]
    assert "python -m cbteach preflight" in blocks[0] and "jupyter lab --config=tools/lab_config.py" in blocks[1]


def test_the_colab_warning_carries_the_last_gpu_run():
    gpu = json.loads((ROOT / "benchmarks" / "results" / "gpu.json").read_text())
    colab = section("4. Colab")
    right, total = gpu["exact_fp32"]["paged"]
    assert f"**{['0', 'one', 'two'][right] if right < 3 else right} of {total}**" in colab
    assert gpu["run"]["date"] in colab and gpu["device"].split()[-1] in colab
    assert "not verified on a GPU" in colab and "CPU runtime for notebooks 05, 06, 06b and 12" in colab
    assert "make gpu-check" in colab


def test_the_tournament_sheet_states_the_trace_and_the_rules_the_code_uses():
    rules = section("5. The tournament's rules")
    t = Trace()
    for said in (f"{t.num_requests} requests", f"{t.rate:g} a second", f"seed {t.seed}",
                 f"{int(t.long_share * 100)}% of them", f"{t.long_prompt[0]}-{t.long_prompt[1]} tokens",
                 f"({t.short_prompt[0]}-{t.short_prompt[1]})", f"{t.output[0]}-{t.output[1]}\noutput tokens",
                 f"{t.max_batch_size} slots", f"budget of {t.token_budget} tokens", f"{t.num_blocks} blocks of {t.block_size}",
                 f"<= {t.ttft_slo:g} s", f"<= {t.tpot_slo:g} s", f"{t.step_overhead * 1000:g} ms",
                 f"{t.per_token * 1000:g} ms per token", f"`{BASELINE}`"):
        assert said in rules, said
    for rule in ("ties", "they share the place", "calls `super()` counts", "deadline is yours", "beat the baseline"):
        assert rule.lower() in rules.lower(), rule
    assert KIT.count("super().schedule(now)") == 2 and KIT.count("calls `super()` counts") == 1  # one place


def test_the_handout_count_is_the_notebooks():
    sys.path.insert(0, str(ROOT / "tools"))
    import handouts

    books = sorted((ROOT / "notebooks").glob("*.ipynb"))
    cells = sum(SOLUTION_TAG in c.get("metadata", {}).get("tags", []) for b in books
                for c in json.loads(b.read_text(encoding="utf-8"))["cells"])
    exercises = sum(len(handouts.exercises(b)) for b in books)
    assert f"{exercises} today, from the {cells} code cells tagged `solution`" in section("6. Solution handouts")


def test_the_instructor_kit_counts_05b_s_steps_and_says_90_minutes_in_one_meaning():
    from cbteach.exercises.ex05b import STEPS

    kit = (ROOT / "notebooks" / "INSTRUCTOR.md").read_text(encoding="utf-8")
    words = {8: "eight", 9: "nine", 10: "ten", 11: "eleven", 12: "twelve"}
    assert f"on {words.get(len(STEPS), len(STEPS))} hand-built steps (`STEPS`" in kit
    assert "90-minute slot:" not in kit  # each notebook's cuts are "When time is short"
    assert "\nWhen time is short:" in kit


def test_the_tournaments_time_limits_the_kit_states_are_the_codes():
    from cbteach.exercises.tournament_core import LOAD_TIME_LIMIT

    text = " ".join(KIT.split())
    assert f"`Trace.time_limit` wall seconds ({Trace.time_limit:g};" in text
    assert f"`LOAD_TIME_LIMIT` ({LOAD_TIME_LIMIT:g} s)" in text
