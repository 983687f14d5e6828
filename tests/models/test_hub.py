"""A model named by a hub id: one early check, one plain message per way it fails, no half-minute of retries.

The hub is never contacted: errors are raised by a stand-in for `HfApi.model_info`, and the hub cache is a
folder written here (the layout `hf download` leaves: refs/main -> snapshots/<commit>/...).
"""

from __future__ import annotations

import importlib
import shutil
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

from tests.helpers.hub import fake_hub_cache
from vidtune.config import ModelConfig
from vidtune.errors import ModelError
from vidtune.models.ltx_video import LTXVideoSpec

# The HTTP client whose responses the hub's errors carry: httpx2 from huggingface_hub 2, httpx before.
http = importlib.import_module("httpx2" if int(huggingface_hub.__version__.split(".")[0]) >= 2 else "httpx")
REPO = "someone/tiny-ltx"
def spec_for(pretrained: str, **settings) -> LTXVideoSpec:
    return LTXVideoSpec(ModelConfig(name="ltx-video", pretrained=pretrained, **settings))


def answer(error_class, status: int):
    """A stand-in for HfApi.model_info that raises `error_class` as the hub's answer with `status`."""
    def model_info(self, repo_id, **kwargs):
        request = http.Request("GET", f"https://huggingface.co/api/models/{repo_id}")
        raise error_class(f"{status} Client Error", response=http.Response(status, request=request))
    return model_info


def test_offline_and_not_in_the_cache_says_so_and_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelError) as error:
        spec_for("Lightricks/LTX-Video").check_source()
    message = str(error.value)
    assert "Lightricks/LTX-Video is not in this machine's hub cache" in message
    assert "HF_HUB_OFFLINE=1" in message and "hf download Lightricks/LTX-Video" in message
    assert message.splitlines()[-1].startswith("What to do:")


def test_offline_with_the_model_in_the_cache_passes_and_loads_it(monkeypatch, tmp_path, tiny_model_dir):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    fake_hub_cache(tmp_path / "cache", REPO, tiny_model_dir("ltx-video"))
    spec = spec_for(REPO)
    spec.check_source()
    spec.check_video_shape(9, 32, 32)  # reads the VAE config from the cached snapshot


def test_offline_cache_without_a_subfolder_names_it(monkeypatch, tmp_path, tiny_model_dir):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    fake_hub_cache(tmp_path / "cache", REPO, tiny_model_dir("ltx-video"), without=("vae",))
    with pytest.raises(ModelError, match=r"has no vae subfolder\(s\), which a ltx-video model"):
        spec_for(REPO).check_source()


def test_local_folder_without_a_subfolder_names_it(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir("ltx-video"), tmp_path / "model", ignore=shutil.ignore_patterns("transformer"))
    with pytest.raises(ModelError) as error:
        spec_for(str(tmp_path / "model")).check_source()
    assert "missing subfolder(s): transformer" in str(error.value)
    assert str(error.value).splitlines()[-1].startswith("What to do:")


def test_unreachable_hub_fails_at_once_and_says_what_to_do(monkeypatch, tmp_path, tiny_model_dir):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: refused at once
    with pytest.raises(ModelError) as error:
        spec_for(REPO).check_source()
    message = str(error.value)
    assert "cannot reach the Hugging Face hub (http://127.0.0.1:9)" in message
    assert f"hf download {REPO} --local-dir tiny-ltx" in message and "does not appear to have" not in message

    # The same, with the model in the hub cache: use it offline.
    snapshot = fake_hub_cache(tmp_path / "cache", REPO, tiny_model_dir("ltx-video"))
    with pytest.raises(ModelError, match="run again with HF_HUB_OFFLINE=1") as error:
        spec_for(REPO).check_source()
    assert str(snapshot) in str(error.value)


@pytest.mark.parametrize(("error_class", "status", "settings", "expected"), [
    (GatedRepoError, 403, {}, f"{REPO} is a gated repository"),
    (RepositoryNotFoundError, 404, {}, f"there is no model {REPO} on the hub"),
    (RevisionNotFoundError, 404, {"revision": "v9"}, f"model.revision: 'v9' is not a branch, tag or commit of {REPO}"),
])
def test_each_hub_refusal_has_its_own_message(monkeypatch, error_class, status, settings, expected):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "model_info", answer(error_class, status))
    with pytest.raises(ModelError) as error:
        spec_for(REPO, **settings).check_source()
    assert expected in str(error.value)
    assert str(error.value).splitlines()[-1].startswith("What to do:")


def test_a_hub_repository_without_a_subfolder_names_it(monkeypatch):
    files = [f"{name}/config.json" for name in ("text_encoder", "tokenizer", "vae", "scheduler")]
    info = SimpleNamespace(siblings=[SimpleNamespace(rfilename=name) for name in files])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "model_info", lambda self, repo_id, **kwargs: info)
    with pytest.raises(ModelError, match=rf"the hub repository {REPO} has no transformer subfolder"):
        spec_for(REPO).check_source()
    # A transformer given elsewhere is not needed from the repository.
    spec_for(REPO, subfolders={"transformer": "/elsewhere/transformer"}).check_source()


def test_the_hub_is_asked_once(monkeypatch):
    calls = []

    def model_info(self, repo_id, **kwargs):
        calls.append(repo_id)
        return SimpleNamespace(siblings=[])

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "model_info", model_info)
    spec = LTXVideoSpec(ModelConfig(name="ltx-video", pretrained=REPO, subfolders={
        name: f"/x/{name}" for name in ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")}))
    spec.check_source()
    spec.check_source()
    assert calls == [REPO]
    # The answer is the spec's, for its run: another spec (another run) asks again; nothing outlives the spec.
    LTXVideoSpec(spec.config).check_source()
    assert calls == [REPO, REPO]


def test_a_failed_check_is_asked_again(monkeypatch):
    answers = iter([http.ConnectError("refused"), SimpleNamespace(siblings=[])])

    def model_info(self, repo_id, **kwargs):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "model_info", model_info)
    spec = LTXVideoSpec(ModelConfig(name="ltx-video", pretrained=REPO, subfolders={
        name: f"/x/{name}" for name in ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")}))
    with pytest.raises(ModelError, match="cannot reach the Hugging Face hub"):
        spec.check_source()
    spec.check_source()  # the hub answers now: the earlier failure was not kept
