"""The resume store's linked models (issue 43): a state names the checkpoints a server has just written
instead of holding the models again; what it links, what it removes, and what it refuses."""

from __future__ import annotations

import os

import cxrfl.common.io as io_module
import pytest
import torch
from cxrfl.common.io import torch_save
from cxrfl.common.resume import ResumeStore
from cxrfl.errors import ConfigError


def checkpoint(path, value: float):
    torch_save(
        path, {"model": {"w": torch.full((2, 3), value)}, "classes": ["a", "b"], "format": "cxrfl-checkpoint-v1"}
    )
    return path


def test_a_state_links_its_models_and_loads_them_back(tmp_path):
    out = tmp_path / "out"
    store = ResumeStore(tmp_path / "resume", "job-1")
    store.save({"settings": {"lr": 1.0}, "round": 1, "params": "not saved"}, {"params": checkpoint(out / "g.pt", 1.0)})
    raw = torch.load(store.folder / "state.pt", weights_only=True)
    assert "params" not in raw and os.path.samefile(store.folder / raw["models"]["params"], out / "g.pt")
    checkpoint(out / "g.pt", 2.0)  # the next round's model replaces the file: the link keeps round 1's
    state = ResumeStore(tmp_path / "resume", "job-2").load("job-1", {"lr": 1.0}, ["lr"])
    assert state["round"] == 1 and torch.equal(state["params"]["w"], torch.full((2, 3), 1.0))


def test_an_unchanged_model_keeps_its_link_and_a_replaced_one_leaves_no_stale_file(tmp_path):
    out, store = tmp_path / "out", ResumeStore(tmp_path / "resume", "job-1")
    best = checkpoint(out / "best.pt", 0.5)
    store.save({"round": 1}, {"params": checkpoint(out / "g.pt", 1.0), "best_params": best})
    first = torch.load(store.folder / "state.pt", weights_only=True)["models"]
    store.save({"round": 2}, {"params": checkpoint(out / "g.pt", 2.0), "best_params": best})
    second = torch.load(store.folder / "state.pt", weights_only=True)["models"]
    assert second["best_params"] == first["best_params"] and second["params"] != first["params"]
    assert sorted(p.name for p in store.folder.iterdir()) == sorted(["state.pt", *second.values()])
    store.save({"round": 3})  # no model named any more (e.g. FedFew keeps its own): the links go
    assert [p.name for p in store.folder.iterdir()] == ["state.pt"]


def test_across_file_systems_the_model_is_copied(tmp_path, monkeypatch):
    def no_links(*args):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(io_module.os, "link", no_links)
    store = ResumeStore(tmp_path / "resume", "job-1")
    store.save({"round": 1}, {"params": checkpoint(tmp_path / "g.pt", 1.0)})
    name = torch.load(store.folder / "state.pt", weights_only=True)["models"]["params"]
    assert not os.path.samefile(store.folder / name, tmp_path / "g.pt")
    assert torch.equal(ResumeStore.read(store.folder / "state.pt")["params"]["w"], torch.full((2, 3), 1.0))


@pytest.mark.parametrize("name", ["../g.pt", "/tmp/g.pt", ".."])
def test_a_model_name_that_leaves_the_folder_is_refused(tmp_path, name):
    checkpoint(tmp_path / "resume" / "g.pt", 1.0)
    torch_save(tmp_path / "resume" / "job-1" / "state.pt", {"round": 1, "models": {"params": name}})
    with pytest.raises(ConfigError, match="not a plain name"):
        ResumeStore(tmp_path / "resume", "job-2").load("job-1", {}, [])


def test_a_missing_or_foreign_model_file_is_one_line_naming_it(tmp_path):
    folder = tmp_path / "resume" / "job-1"
    torch_save(folder / "state.pt", {"round": 1, "models": {"params": "params-1.pt"}})
    with pytest.raises(ConfigError) as err:
        ResumeStore.read(folder / "state.pt")
    assert str(folder / "params-1.pt") in str(err.value) and "\n" not in str(err.value)
    torch_save(folder / "params-1.pt", {"w": torch.zeros(2)})  # tensors, but not a checkpoint
    with pytest.raises(ConfigError, match="is not a cxrfl checkpoint; delete"):
        ResumeStore.read(folder / "state.pt")
