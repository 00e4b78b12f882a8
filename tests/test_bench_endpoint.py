"""``bench-serve`` against a real cbteach server on 127.0.0.1: every request measured, the numbers consistent."""
import json

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'cbteach[serve]')")

from cbteach.bench import endpoint  # noqa: E402


@pytest.fixture(scope="module")
def url():
    from cbteach.serving.server import ServerThread

    with ServerThread(["--port", "0", "--max-batch-size", "4"]) as s:
        yield s.url


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_bench_serve_measures_every_request(url, tmp_path, capsys, api):
    out = tmp_path / "r.json"
    rc = endpoint.main(["--endpoint", url, "--api", api, "--workload", "length_variance", "--requests", "6",
                        "--cap", "8", "--concurrency", "1,3", "--warmup", "1", "--json", str(out)])
    assert rc == 0, capsys.readouterr()
    result = json.loads(out.read_text())
    lengths = result["workload"]["max_new_tokens"]
    for row in result["rows"]:
        assert row["num_failed"] == 0 and row["num_completed"] == 6
        # EOS ignored: every request made exactly its drawn length, counted from what the server sent back
        assert row["output_tokens"] == round(lengths["mean"] * 6)
        assert 0 < row["ttft_p50"] <= row["e2e_p50"] and row["tokens_per_s"] > 0
    assert [r["concurrency"] for r in result["rows"]] == [1, 3]
    said = capsys.readouterr()
    assert "TTFT p50/p99" in said.out
    assert "bench-serve, 3 clients" in said.err and "/6" in said.err  # the progress bar, on stderr


def test_bench_serve_no_progress_draws_no_bar(url, capsys):
    assert endpoint.main(["--endpoint", url, "--requests", "2", "--max-new-tokens", "2", "--warmup", "0",
                          "--no-progress"]) == 0
    assert "bench-serve," not in capsys.readouterr().err


def test_bench_serve_reports_a_missing_server_and_bad_options(capsys):
    assert endpoint.main(["--endpoint", "http://127.0.0.1:9", "--requests", "2", "--warmup", "0",
                          "--timeout", "5"]) == 1
    assert "ConnectError" in capsys.readouterr().out
    assert endpoint.main(["--endpoint", "http://127.0.0.1:9", "--concurrency", "0"]) == 2
    assert "--concurrency" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [(["--rate", "0"], "argument --rate: '0' is not a number > 0"),
                                        (["--requests", "0"], "argument --requests: '0' is not an integer > 0"),
                                        (["--cap", "x"], "argument --cap: 'x' is not an integer > 0"),
                                        (["--timeout", "inf"], "argument --timeout: 'inf' is not a number > 0")])
def test_bench_serve_errors_name_the_flag_typed(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        endpoint.main(["--endpoint", "http://127.0.0.1:9", *argv])
    assert e.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [(["--cap", "4"], "headwords would ignore --cap"),
                                        (["--workload", "chat", "--rate", "2"], "chat would ignore --rate")])
def test_bench_serve_refuses_an_option_its_workload_would_ignore(argv, said, capsys):
    assert endpoint.main(["--endpoint", "http://127.0.0.1:9", *argv]) == 2
    assert said in capsys.readouterr().err


def test_bench_serve_help_never_prints_the_key(monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-help-text")
    with pytest.raises(SystemExit):
        endpoint.main(["--help"])
    text = capsys.readouterr().out
    assert "sk-not-for-help-text" not in text and "$OPENAI_API_KEY" in text and "(default: None)" not in text
