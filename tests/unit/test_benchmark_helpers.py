"""kimi.benchmarks' CPU parts: the serving benchmark's base URL and model choice, and the snapshot files' names,
command line and shape."""

import json

import pytest

from kimi.benchmarks import snapshot
from kimi.benchmarks.serving import auth_headers, normalize_base_url, pick_model, summary_line


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000",
        "http://127.0.0.1:8000/",
        "http://127.0.0.1:8000/v1",
        "http://127.0.0.1:8000/v1/",
        " http://127.0.0.1:8000/v1 ",
    ],
)
def test_a_base_url_with_or_without_v1_gives_the_root(url):
    assert normalize_base_url(url) == "http://127.0.0.1:8000"


def test_a_path_before_v1_is_kept_and_a_url_without_scheme_is_refused():
    assert normalize_base_url("https://example.com/kimi/v1") == "https://example.com/kimi"
    assert normalize_base_url("https://example.com/v1x") == "https://example.com/v1x"
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        normalize_base_url("127.0.0.1:8000/v1")


def test_the_only_model_is_picked_and_several_are_named():
    assert pick_model({"object": "list", "data": [{"id": "tiny-k2.6", "object": "model"}]}, "http://h") == "tiny-k2.6"
    with pytest.raises(ValueError, match=r"lists 2 models \(a, b\): choose one with --model"):
        pick_model({"data": [{"id": "a"}, {"id": "b"}]}, "http://h")
    with pytest.raises(ValueError, match="lists no model"):
        pick_model({"data": []}, "http://h")
    with pytest.raises(ValueError, match="not an OpenAI model list"):
        pick_model({"error": "x"}, "http://h")


def test_api_key_header_and_summary_line():
    assert auth_headers(None) == {} and auth_headers("") == {}
    assert auth_headers("k") == {"Authorization": "Bearer k"}
    rep = {
        "num_requests": 8,
        "errors": 1,
        "output_token_throughput_per_s": 1234.4,
        "request_throughput_per_s": 3.217,
        "ttft": {"p50_ms": 12.34},
        "tpot": {"p50_ms": None},
    }
    assert summary_line(rep) == ("8 requests, 1 errors: 1234 output tok/s, 3.22 req/s, TTFT p50 12.3 ms, TPOT p50 n/a")


def test_snapshot_names_devices_and_command_line():
    assert snapshot.device_key("NVIDIA H200") == "h200"
    assert snapshot.device_key("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert snapshot.device_key(None) == "cpu"
    assert snapshot.snapshot_name("decode", "int4-ep8") == "decode_int4-ep8"
    assert snapshot.snapshot_name("mla") == "mla"
    with pytest.raises(ValueError, match="letters, digits"):
        snapshot.snapshot_name("decode", "a/b")
    script = str(snapshot.REPO / "tools" / "bench_decode.py")
    cmd = snapshot.command_line([script, "--seqs", "8,32", "--snapshot", "/tmp/out", "--api-key", "secret", "--x"])
    assert cmd == "python tools/bench_decode.py --seqs 8,32 --snapshot --api-key '***' --x"
    assert snapshot.command_line(["t.py", "--snapshot=/r", "--api-key=s"]) == "python t.py --snapshot '--api-key=***'"


def test_a_snapshot_is_written_in_the_common_shape_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_GIT_COMMIT", "abc123")
    conds = snapshot.conditions(gpu=False, note="n")
    assert conds["commit"] == "abc123" and conds["note"] == "n" and "gpu" not in conds
    summary = {"columns": ["a", "b"], "rows": [[1, 2.5]], "notes": ["x"]}
    path = snapshot.write(
        tmp_path, benchmark="bench", config="c1", summary=summary, results={"r": 1}, conds=conds, command="python t.py"
    )
    assert path == tmp_path / "cpu" / "bench_c1.json"
    doc = json.loads(path.read_text())
    assert set(doc) == {"benchmark", "config", "command", "conditions", "summary", "results"}
    assert snapshot.load_all(tmp_path) == {"cpu/bench_c1": doc}
    for bad in (
        {"columns": ["a"], "rows": [[1, 2]]},
        {"columns": "a", "rows": []},
        {"columns": [], "rows": [], "x": 1},
    ):
        with pytest.raises(ValueError):
            snapshot.write(tmp_path, benchmark="b", config="", summary=bad, results={}, conds=conds)
