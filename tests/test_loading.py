"""Loading at the speed of the device: worker sizing and seeding, the site's preprocessing cache on
disk (hits, misses, invalidation, where it is written), batches finished on the device."""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path

import cxrfl.data.transforms as transforms_module
import numpy as np
import pandas as pd
import pytest
import torch
from cxrfl.data import cache as cache_module
from cxrfl.data.cache import IMAGE_CACHE, cache_size, disk_cache
from cxrfl.data.dataset import DeviceLoader, make_loader, reseed, resolve_workers
from cxrfl.data.transforms import BatchTransform, build_transforms, preprocess_transforms
from cxrfl.errors import ConfigError
from monai.data.utils import set_rnd
from monai.transforms import AdjustContrast, Flip, Rotate, Zoom
from PIL import Image

N = 6


def write_png(path: Path, index: int, size: int = 40) -> None:
    """A distinct image per index: a bright band at its own height on a ramp."""
    img = np.tile(np.linspace(0, 120, size), (size, 1))
    img[5 * index : 5 * index + 5] = 255
    Image.fromarray(img.astype(np.uint8)).save(path)


@pytest.fixture
def table(tmp_path: Path) -> pd.DataFrame:
    (tmp_path / "images").mkdir()
    rows = []
    for i in range(N):
        write_png(tmp_path / "images" / f"{i}.png", i)
        rows.append({"path": str(tmp_path / "images" / f"{i}.png"), "A": float(i % 2), "B": 1.0})
    return pd.DataFrame(rows)


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """Paths decoded by the pipeline (the reader the transforms call, counted)."""
    seen: list[str] = []
    real = transforms_module.read_image

    def counting(path):
        seen.append(str(path))
        return real(path)

    monkeypatch.setattr(transforms_module, "read_image", counting)
    return seen


def epoch(loader) -> list[torch.Tensor]:
    return [x for x, _, _ in loader]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------ workers


def test_num_workers_auto_is_sized_from_the_cores_and_ints_pass(monkeypatch) -> None:
    assert [resolve_workers("auto", cores=c) for c in (1, 2, 4, 64)] == [0, 1, 3, 8]
    monkeypatch.setattr("cxrfl.data.dataset.available_cores", lambda: 5)
    assert resolve_workers("auto") == 4
    assert resolve_workers(0) == 0 and resolve_workers(12) == 12
    for bad in ("many", -1, True, 1.5, "4"):
        with pytest.raises(ConfigError, match="num_workers must be 'auto' or an integer"):
            resolve_workers(bad)


def test_a_last_training_batch_of_one_image_is_left_out_so_batchnorm_can_train(tmp_path: Path) -> None:
    from cxrfl.nn.models import ModelConfig, build_model
    from cxrfl.nn.training import adam, train_epochs

    (tmp_path / "images").mkdir()
    for i in range(5):
        write_png(tmp_path / "images" / f"{i}.png", i % N, size=48)
    rows = [{"path": str(tmp_path / "images" / f"{i}.png"), "A": float(i % 2)} for i in range(5)]

    def sizes(n: int, train: bool) -> list[int]:
        loader = make_loader(pd.DataFrame(rows[:n]), ["A"], image_size=16, train=train, batch_size=2)
        return [len(x) for x in epoch(loader)]

    assert sizes(5, train=True) == [2, 2] and sizes(4, train=True) == [2, 2]  # 5 = 2 + 2 + 1: the 1 is left out
    assert sizes(5, train=False) == [2, 2, 1]  # evaluation scores every image
    # DenseNet121 at 48 px ends on a 1x1 map: BatchNorm in training mode cannot take a batch of one image there
    torch.manual_seed(0)
    model = build_model(ModelConfig(image_size=48), 1)
    loader = make_loader(pd.DataFrame(rows), ["A"], image_size=48, train=True, batch_size=2)
    stats = train_epochs(model, loader, adam(model, 1e-3), torch.device("cpu"))
    assert stats.images == 4


def test_workers_persist_and_prefetch(table: pd.DataFrame) -> None:
    loader = make_loader(table, ["A"], image_size=16, train=False, batch_size=2, num_workers=2)
    assert loader.num_workers == 2 and loader.persistent_workers and loader.prefetch_factor == 2
    assert not make_loader(table, ["A"], image_size=16, train=False, batch_size=2).persistent_workers


def test_workers_seed_augmentation_reproducibly(table: pd.DataFrame, tmp_path: Path) -> None:
    def two_epochs(seed: int, workers: int = 2) -> list[torch.Tensor]:
        loader = make_loader(
            table,
            ["A"],
            image_size=24,
            train=True,
            batch_size=2,
            num_workers=workers,
            seed=seed,
            cache_dir=tmp_path / "cache",
        )
        return epoch(loader) + epoch(loader)

    first = two_epochs(3)
    assert same(first, two_epochs(3))  # same seed: the same shuffling and augmentation in each worker
    assert not same(first, two_epochs(4))
    assert not same(first[:3], first[3:])  # the second epoch draws anew
    plain = make_loader(table, ["A"], image_size=24, train=False, batch_size=N)
    assert not any(torch.equal(x, epoch(plain)[0][: len(x)]) for x in first)  # something was augmented


def test_each_worker_draws_its_own_augmentation(table: pd.DataFrame) -> None:
    """One image repeated, one per batch, two workers taking turns: worker 0's k-th batch and worker
    1's k-th batch would be equal if the workers shared one random state (seeded alike)."""
    same_image = table.assign(path=table["path"][0])
    batches = epoch(make_loader(same_image, ["A"], image_size=24, train=True, batch_size=1, num_workers=2, seed=0))
    assert not all(torch.equal(batches[k], batches[k + 1]) for k in range(0, N, 2))
    assert len({b.sum().item() for b in batches}) > 1


# ------------------------------------------------------------------ the cache on disk


def test_cache_fills_in_the_first_epoch_and_is_read_afterwards(
    table: pd.DataFrame, tmp_path: Path, reads: list[str]
) -> None:
    root = tmp_path / "state" / IMAGE_CACHE
    first = epoch(make_loader(table, ["A"], image_size=16, train=False, batch_size=4, cache_dir=root))
    assert sorted(reads) == sorted(table["path"]) and cache_size(root)[0] == N
    reads.clear()
    again = epoch(make_loader(table, ["A"], image_size=16, train=False, batch_size=4, cache_dir=root))
    train = epoch(make_loader(table, ["A"], image_size=16, train=True, batch_size=4, cache_dir=root))
    assert reads == [] and same(first, again) and len(train) == 2  # a new loader, the training split: all hits
    files, size = cache_size(root)
    assert files == N and size >= N * 16 * 16 * 4  # one float32 [1, 16, 16] tensor per image


def test_a_changed_image_is_decoded_again(table: pd.DataFrame, tmp_path: Path, reads: list[str]) -> None:
    root = tmp_path / IMAGE_CACHE
    epoch(make_loader(table, ["A"], image_size=16, train=False, batch_size=N, cache_dir=root))
    changed = Path(table["path"][2])
    write_png(changed, 5)
    stamp = changed.stat().st_mtime_ns + 10**9
    os.utime(changed, ns=(stamp, stamp))
    reads.clear()
    (cached,) = epoch(make_loader(table, ["A"], image_size=16, train=False, batch_size=N, cache_dir=root))
    assert reads == [str(changed)]
    (fresh,) = epoch(make_loader(table, ["A"], image_size=16, train=False, batch_size=N))
    assert torch.equal(cached, fresh) and torch.equal(cached[2], cached[5])  # the new content, not the old


def test_a_new_input_size_or_intensity_policy_starts_a_new_chain(
    table: pd.DataFrame, tmp_path: Path, reads: list[str], monkeypatch
) -> None:
    root = tmp_path / IMAGE_CACHE

    def fill(size: int) -> None:
        reads.clear()
        epoch(make_loader(table, ["A"], image_size=size, train=False, batch_size=N, cache_dir=root))

    fill(16)
    fill(24)
    assert len(reads) == N and sorted(p.name.split("-")[0] for p in root.iterdir()) == ["16px", "24px"]
    fill(16)
    assert reads == []  # the previous chain is kept (KEEP_CHAINS = 2)
    monkeypatch.setattr(transforms_module, "_policy_digest", lambda: "another reading policy")
    fill(16)
    assert len(reads) == N  # same size, other intensity policy: everything again
    assert len(list(root.iterdir())) == cache_module.KEEP_CHAINS  # the least recently used chain went


def test_a_site_config_change_that_keeps_the_images_keeps_the_cache(
    table: pd.DataFrame, tmp_path: Path, reads: list[str]
) -> None:
    root = tmp_path / IMAGE_CACHE
    epoch(make_loader(table, ["A"], image_size=16, train=False, batch_size=N, cache_dir=root))
    relabelled = table.assign(A=1.0 - table["A"], C=0.0).iloc[1:]  # other labels, classes and split rows
    reads.clear()
    x, y, _ = next(iter(make_loader(relabelled, ["C", "A"], image_size=16, train=False, batch_size=N, cache_dir=root)))
    assert reads == [] and x.shape[0] == N - 1 and y[:, 1].tolist() == relabelled["A"].tolist()
    moved = tmp_path / "moved"
    moved.mkdir()
    for p in table["path"]:  # the same files at another place (another images: folder): other entries
        Path(p).rename(moved / Path(p).name)
    epoch(
        make_loader(
            table.assign(path=[str(moved / Path(p).name) for p in table["path"]]),
            ["A"],
            image_size=16,
            train=False,
            batch_size=N,
            cache_dir=root,
        )
    )
    assert len(reads) == N


def test_cache_files_are_written_in_place_never_staged_in_the_temp_folder(
    table: pd.DataFrame, tmp_path: Path, monkeypatch
) -> None:
    def staged(*args, **kwargs):
        raise AssertionError("a cache file was staged in the system temp folder")

    monkeypatch.setattr(tempfile, "mkdtemp", staged)  # MONAI's own PersistentDataset stages there
    root = tmp_path / IMAGE_CACHE
    epoch(make_loader(table, ["A"], image_size=16, train=False, batch_size=N, cache_dir=root))
    assert cache_size(root)[0] == N and {p.parent.parent for p in root.rglob("*.pt")} == {root}


def test_an_unreadable_cache_file_is_computed_again(table: pd.DataFrame, tmp_path: Path, reads: list[str]) -> None:
    root = tmp_path / IMAGE_CACHE
    (first,) = epoch(make_loader(table, ["A"], image_size=16, train=False, batch_size=N, cache_dir=root))
    victim = sorted(root.rglob("*.pt"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    reads.clear()
    (again,) = epoch(make_loader(table, ["A"], image_size=16, train=False, batch_size=N, cache_dir=root))
    assert len(reads) == 1 and torch.equal(first, again)


def test_cached_and_uncached_paths_give_identical_tensors(table: pd.DataFrame, tmp_path: Path) -> None:
    root = tmp_path / IMAGE_CACHE
    deterministic = preprocess_transforms(32)
    cached = disk_cache(table["path"], 32, root)
    for i, path in enumerate(table["path"]):
        direct = deterministic(path)
        assert direct.shape == (1, 32, 32) and direct.dtype == torch.float32
        assert torch.equal(cached[i], direct)  # cold: computed and written
    reread = disk_cache(table["path"], 32, root)
    assert all(torch.equal(reread[i], deterministic(p)) for i, p in enumerate(table["path"]))  # warm: read back

    def batches(**kw) -> list[torch.Tensor]:
        return epoch(make_loader(table, ["A"], image_size=32, train=False, batch_size=4, **kw))

    files = batches()
    assert same(files, batches(cache_dir=root)) and same(files, batches(cache=True))
    assert same(files, batches(cache_dir=root, num_workers=2))
    full = build_transforms(32, train=False)
    assert all(torch.equal(files[0][i], full(table["path"][i])) for i in range(4))


# ------------------------------------------------------------------ batches finished on the device


def test_device_batches_equal_the_per_image_pipeline(table: pd.DataFrame, tmp_path: Path) -> None:
    for channels in (3, 1):
        cpu = epoch(make_loader(table, ["A"], image_size=32, train=False, batch_size=4, in_channels=channels))
        loader = make_loader(
            table,
            ["A"],
            image_size=32,
            train=False,
            batch_size=4,
            in_channels=channels,
            cache_dir=tmp_path / "c",
            device=torch.device("cpu"),
            device_transforms=True,
        )
        assert isinstance(loader, DeviceLoader)
        on_device = epoch(loader)
        assert [x.shape for x in on_device] == [x.shape for x in cpu] and on_device[0].shape[1] == channels
        for a, b in zip(cpu, on_device):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def augmenting_on_device(table: pd.DataFrame, tmp_path: Path, seed: int, workers: int = 0) -> DeviceLoader:
    """A training loader that augments on the device (the CPU here), as a CUDA site's does."""
    loader = make_loader(
        table,
        ["A"],
        image_size=32,
        train=True,
        batch_size=3,
        seed=seed,
        num_workers=workers,
        cache_dir=tmp_path / "c",
        device=torch.device("cpu"),
        device_transforms=True,
    )
    assert isinstance(loader, DeviceLoader)
    return loader


def test_device_augmentation_is_seeded_and_reseedable(table: pd.DataFrame, tmp_path: Path) -> None:
    def loader(seed: int):
        return augmenting_on_device(table, tmp_path, seed)

    first = loader(1)
    a = epoch(first)
    assert same(a, epoch(loader(1))) and not same(a, epoch(loader(2)))
    assert a[0].shape == (3, 3, 32, 32) and torch.isfinite(torch.cat(a)).all()
    assert first.sampler is first.loader.sampler and first.dataset.batch_transform is not None
    set_rnd(first.dataset, 7)  # how the relay reseeds a visit
    first.sampler.generator.manual_seed(7)
    b = epoch(first)
    set_rnd(first.dataset, 7)
    first.sampler.generator.manual_seed(7)
    assert same(b, epoch(first))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reseeded_loader_gives_the_batches_of_a_new_one_and_keeps_its_workers(
    table: pd.DataFrame, tmp_path: Path, workers: int
) -> None:
    def loader(seed: int):
        return augmenting_on_device(table, tmp_path, seed, workers)

    kept = loader(1)
    first = epoch(kept)
    iterator = kept.loader._iterator
    reseed(kept, 2)
    assert same(epoch(kept), epoch(loader(2))) and not same(first, epoch(loader(2)))
    reseed(kept, 1)
    assert same(epoch(kept), first)
    if workers:
        assert kept.loader._iterator is iterator  # the same worker processes served every epoch
    with pytest.raises(ValueError, match="on the device"):
        reseed(make_loader(table, ["A"], image_size=32, train=True, batch_size=3), 1)


def smooth_image(size: int = 64) -> torch.Tensor:
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
    return (torch.exp(-4 * ((xx - 0.3) ** 2 + (yy + 0.2) ** 2)) + 0.3 * (xx + 1))[None].float()


def test_batch_augmentation_steps_match_monai() -> None:
    x = smooth_image()
    batch = BatchTransform(1, augment=True)
    zero, one = torch.zeros(1), torch.ones(1)
    for degrees in (8.0, -8.0):
        angle = math.radians(degrees)
        monai = Rotate(angle=angle, padding_mode="zeros")(x).as_tensor()
        ours = batch.geometry(x[None], torch.tensor([angle]), one, one)[0]
        torch.testing.assert_close(ours, monai, rtol=0, atol=1e-5)
    flipped = batch.geometry(x[None], zero, -one, one)[0]
    torch.testing.assert_close(flipped, Flip(spatial_axis=1)(x).as_tensor(), rtol=0, atol=1e-5)
    monai_in = Zoom(zoom=1.1, mode="bilinear", padding_mode="constant")(x).as_tensor()  # resized to 70 px, cropped
    ours_in = batch.geometry(x[None], zero, one, torch.tensor([70 / 64]))[0]
    torch.testing.assert_close(ours_in, monai_in, rtol=0, atol=1e-5)
    monai_out = Zoom(zoom=0.9, mode="bilinear", padding_mode="constant")(x).as_tensor()  # 57 px, padded 3 + 4
    ours_out = batch.geometry(x[None], zero, one, torch.tensor([57 / 64]))[0]  # centred: half a pixel apart
    assert float(ours_out[:, :3].abs().max()) == 0 and float(monai_out[:, :3].abs().max()) == 0
    assert float((ours_out - monai_out)[:, 4:-4, 4:-4].abs().mean()) < 0.02
    gamma = batch.contrast(x[None], torch.tensor([1.3]))[0]
    torch.testing.assert_close(gamma, AdjustContrast(gamma=1.3)(x).as_tensor())
    batch.set_random_state(0)
    p = batch.randomize(4000)
    for key, neutral in (("angle", 0.0), ("flip", 1.0), ("zoom", 1.0), ("gamma", 1.0)):  # each step half the time
        assert 0.45 < float((p[key] != neutral).float().mean()) < 0.55, key
    assert float(p["angle"].abs().max()) <= math.radians(10) and set(p["flip"].tolist()) == {-1.0, 1.0}
    assert 0.9 <= float(p["zoom"].min()) and float(p["zoom"].max()) <= 1.1
    assert 0.7 <= float(p["gamma"].min()) and float(p["gamma"].max()) <= 1.5
    batch.set_random_state(0)
    assert all(torch.equal(p[k], v) for k, v in batch.randomize(4000).items())


def test_a_cuda_loader_pins_memory_and_copies_without_blocking(table: pd.DataFrame, monkeypatch) -> None:
    loader = make_loader(table, ["A"], image_size=16, train=True, batch_size=4, device=torch.device("cuda"))
    assert isinstance(loader, DeviceLoader) and loader.pin_memory and loader.device == torch.device("cuda")
    copies: list[bool] = []
    real_to = torch.Tensor.to

    def fake_to(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            copies.append(kwargs.get("non_blocking", False))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    with pytest.warns(UserWarning, match="pin"):  # no accelerator here: torch leaves memory unpinned
        x, _, _ = next(iter(loader))
    assert x.shape == (4, 3, 16, 16) and copies == [True, True, True]  # images, targets, masks


# ------------------------------------------------------------------ where the cache is written


def tree(*roots: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for root in roots for p in root.rglob("*") if p.is_file()}


def test_the_cache_is_written_only_under_the_site_state_root(tmp_path: Path, monkeypatch) -> None:
    """A site executor started in a workspace, answering its warm-up task: every file written
    during the run (the data folder, the workspace and the system temp folder watched) lies under
    ``<workspace>/cxrfl_state``, and the preprocessed images are there."""
    from cxrfl.fl.base import STATE_ROOT
    from cxrfl.fl.surgical import SurgicalExecutor
    from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, build_model
    from cxrfl.synth import write_profile
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    (config,) = write_profile("two-hospitals", tmp_path / "data", n_per_site=24, image_size=48, sites=["hospital-a"])
    ws, temp = tmp_path / "ws", tmp_path / "temp"
    ws.mkdir()
    temp.mkdir()
    monkeypatch.setenv("CXRFL_SITE_CONFIG", str(config))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    class Workspace:
        def get_root_dir(self) -> str:
            return str(ws)

        def get_site_config_dir(self) -> str:
            return str(ws / "local")

    class Engine:
        def get_workspace(self) -> Workspace:
            return Workspace()

        def get_component(self, _: str) -> None:
            return None

        def fire_event(self, *_: object) -> None:
            return None

    ctx = FLContext()
    ctx.get_identity_name = lambda default="": "hospital-a"
    ctx.get_engine = lambda: Engine()
    before = tree(tmp_path)
    executor = SurgicalExecutor(device="cpu", num_workers="auto", num_threads=1, analytic_sender_id="")
    executor.handle_event("_start_run", ctx)
    assert executor.error is None and executor.data.cache_dir == ws / STATE_ROOT / IMAGE_CACHE
    model = ModelConfig(arch="densenet-tiny", image_size=32)  # the network is not the subject here
    params = {k: v.numpy() for k, v in build_model(model, 2).state_dict().items() if not k.startswith(HEAD_PREFIX)}
    meta = {
        "phase": "warmup",
        "round": 0,
        "run_key": "run",
        "model_config": model.to_dict(),
        "train_config": {"warmup_epochs": 1, "batch_size": 4, "max_steps_per_epoch": 2},
    }
    task = FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params=params, meta=meta))
    reply = executor.execute("train", task, ctx, abort_signal=type("Signal", (), {"triggered": False})())
    assert reply.get_return_code() == "OK"
    written = [p for p, stamp in tree(tmp_path).items() if before.get(p) != stamp]
    state = ws / STATE_ROOT
    outside = [str(p) for p in written if not p.is_relative_to(state)]
    assert written and not outside, outside
    assert cache_size(state / IMAGE_CACHE)[0] > 0  # (the watched temp folder holds only torch's worker sockets)


# ------------------------------------------------------------------ the benchmark


def test_loading_benchmark_reports_rates_per_worker_count_and_the_cache_size(tmp_path: Path, monkeypatch) -> None:
    import time

    from cxrfl.bench.loading import LoadingSettings, format_loading, loading_benchmark, loading_verdicts, write_images
    from cxrfl.data.images import read_image

    (dicom,) = write_images("dicom", 1, tmp_path / "dicom")
    gray = read_image(dicom)
    assert gray.shape == (2500, 2048) and 0.0 <= gray.min() < gray.max() <= 1.0
    s = LoadingSettings(
        image_size=32,
        batch_size=2,
        n_images=4,  # whole batches: a last training batch of one image would be left out
        workers=(0, 1),
        warm_epochs=1,
        model_steps=2,
        threads=1,
        device="cpu",
        formats=("png",),
    )
    # issue 44 point 3: "images/s > 0" held for any count; with a clock that advances 0.5 s per reading, every
    # timed pass (two readings) lasts 0.5 s, so each rate is exactly the images of the pass / 0.5 s
    ticks = iter(range(10**6))
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 0.5)
    res = loading_benchmark(s, tmp_path / "work", log=lambda _: None)
    monkeypatch.undo()
    png = res["formats"]["png"]
    assert set(png["workers"]) == {"0", "1"}
    assert res["model"]["images_per_second"] == 2 * 2 / 0.5  # 2 steps of batch 2
    for r in png["workers"].values():  # 4 images per epoch
        assert (r["files"], r["cold"], r["warm"], r["warm_mean"]) == (8.0, 8.0, [8.0], 8.0)
    per_image = png["cache_mb_per_1000_images"] * 1e6 / 1000
    assert 32 * 32 * 4 < per_image < 32 * 32 * 4 + 4096  # one float32 [1, 32, 32] tensor and its file header
    report = "\n".join(format_loading({"loading": res}))
    assert "| png | 1 |" in report and "per 1,000 images" in report
    (verdict,) = loading_verdicts({"loading": res})
    assert re.match(r"png: with the cache warm the loader \([01] worker\(s\)\) delivers at least 3x", verdict)
