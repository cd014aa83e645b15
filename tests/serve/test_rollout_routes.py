"""The RL-rollout routes: off by default (404), behind the API key when on, the weight
folder checked against --weight-update-dir (403), the engine's ValueError a 400; and one
real engine put to sleep, woken and given new weights over HTTP."""
from __future__ import annotations

import httpx

from tests.llmapi.test_rollout import ENGINE, _greedy, models  # noqa: F401
from tllm import LLM
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.http.rollout_routes import SLEEP_ROUTES, WEIGHT_ROUTES
from tllm.serve.testing import FakeLLM, ServerThread

KEY = {"Authorization": "Bearer sesame"}


class RolloutFakeLLM(FakeLLM):
    """Records the rollout calls it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []
        self.is_sleeping = False

    def sleep(self, level: int = 1) -> None:
        if self.active:
            raise ValueError("sleep: requests are unfinished")
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tags))

    def pause_generation(self, abort: bool = False) -> None:
        self.calls.append(("pause_generation", abort))

    def resume_generation(self) -> None:
        self.calls.append(("resume_generation",))

    def update_weights_from_disk(self, path: str) -> None:
        self.calls.append(("update_weights_from_disk", path))


class _Served:
    """A server over `llm` and a client of it, for one `with`."""

    def __init__(self, llm, **config) -> None:
        self.server = ServerThread(build_app(llm, ServerConfig(model="fake", **config)))

    def __enter__(self) -> httpx.Client:
        self.server.__enter__()
        self.client = httpx.Client(base_url=self.server.base_url, timeout=60)
        return self.client

    def __exit__(self, *exc) -> None:
        self.client.close()
        self.server.__exit__(*exc)


def test_routes_are_off_by_default():
    with _Served(RolloutFakeLLM()) as http:
        for path in SLEEP_ROUTES + WEIGHT_ROUTES:
            method = http.get if path == "/is_sleeping" else http.post
            assert method(path).status_code == 404, path


def test_routes_behind_the_key_and_paths_checked(tmp_path):
    allowed = tmp_path / "checkpoints"
    (allowed / "step1").mkdir(parents=True)
    llm = RolloutFakeLLM()
    with _Served(llm, api_key="sesame", enable_sleep_mode=True,
                 weight_update_dirs=(str(allowed),)) as http:
        assert http.post("/sleep").status_code == 401
        assert http.post("/sleep?level=2", headers=KEY).json() == {"success": True}
        assert http.post("/sleep?level=3", headers=KEY).status_code == 400
        assert http.post("/wake_up?tags=weights", headers=KEY).status_code == 200
        assert http.get("/is_sleeping", headers=KEY).json() == {"is_sleeping": False}
        assert http.post("/pause_generation?abort=true", headers=KEY).status_code == 200
        assert http.post("/resume_generation", headers=KEY).status_code == 200
        outside = http.post("/update_weights_from_disk", headers=KEY,
                            json={"model_path": str(allowed / ".." / "elsewhere")})
        assert outside.status_code == 403
        assert outside.json()["error"]["param"] == "model_path"
        inside = http.post("/update_weights_from_disk", headers=KEY,
                           json={"model_path": str(allowed / "step1")})
        assert inside.status_code == 200
    assert llm.calls == [("sleep", 2), ("wake_up", ["weights"]), ("pause_generation", True),
                         ("resume_generation",),
                         ("update_weights_from_disk", str((allowed / "step1").resolve()))]


def test_sleep_wake_and_new_weights_over_http(models):
    (first, expected), (second, expected_second) = models
    parent = str(__import__("pathlib").Path(second).parent)
    with LLM(first, **ENGINE) as llm:
        with _Served(llm, enable_sleep_mode=True, weight_update_dirs=(parent,)) as http:
            assert http.post("/sleep?level=1").status_code == 200
            assert http.get("/is_sleeping").json() == {"is_sleeping": True}
            assert http.post("/wake_up").status_code == 200
            assert _greedy(llm) == expected
            assert http.post("/update_weights_from_disk",
                             json={"model_path": second}).status_code == 200
            assert _greedy(llm) == expected_second


def test_a_paused_or_sleeping_engine_with_work_queued_is_not_stuck():
    llm = RolloutFakeLLM()
    held = {"generation_held": 1}
    llm.get_stats = lambda: {**FakeLLM.get_stats(llm), **held}
    llm.active.add(object())                # work queued, the step counter never moves
    with _Served(llm, stuck_timeout_s=0.0) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/health").status_code == 200
        held["generation_held"] = 0
        http.get("/health")
        assert http.get("/health").status_code == 503
    llm.active.clear()


def test_sleep_mode_policy_flag_becomes_an_llm_argument(capsys):
    import pytest

    from tests.serve.test_serve_cli_args import parse
    from tllm.config import LlmArgs
    from tllm.serve.cli_args import llm_arguments
    _, kwargs = llm_arguments(parse("--sleep-mode-policy", "fail"))
    assert LlmArgs(model="x", **kwargs).sleep_mode_policy == "fail"
    _, kwargs = llm_arguments(parse())
    assert "sleep_mode_policy" not in kwargs      # a --config file's value stands
    with pytest.raises(SystemExit):
        parse("--sleep-mode-policy", "later")
    assert "invalid choice" in capsys.readouterr().err
