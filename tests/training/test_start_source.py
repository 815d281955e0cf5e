"""[sampler] start_source: SDEdit starts of the run's synthetic set from the aux generator's images ("aux")
or every other one ("mix"); the aux generator is fitted to the noised frequency release, so its images are
post-processing of a release. The default ("central") draws exactly as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feta_release.config import load_preset
from feta_release.errors import ConfigError, DataError
from feta_release.models.auxgen import AuxGenerator
from feta_release.stages import freq_warmup, synthesis
from feta_release.stages.freq_warmup import AUX_POOL_PER_CLASS, aux_draw, aux_pool
from feta_release.stages.synthesis import aux_starts, aux_taken, sdedit_starts
from feta_release.training.pipeline import run_pipeline
from tests.support.single_thread import single_thread  # noqa: F401  (autouse fixture)
from tests.support.training import bars, job
from tests.support.training import embedded_subset as _data

FREQ = {"sigma": 10.0, "features": 64}


def _aux(n_classes: int = 2, size: int = 16) -> AuxGenerator:
    torch.manual_seed(0)
    return AuxGenerator(1, size, n_classes, z_dim=4, width=4).eval()


# -- config
# ---------------------------------------------------------------------------------------------------


def test_default_is_central_and_presets_keep_it() -> None:
    assert job().sampler.start_source == "central"
    assert load_preset("tiny").sampler.start_source == "central"


def test_a_default_job_hashes_as_before_the_option_existed() -> None:
    """The default is left out of the job's dict: job hashes, signed jobs, ledgers and model.pt of every job
    that does not use the option stay byte for byte what they were (a run directory of the older code
    resumes)."""
    from feta_release.config import JobConfig

    tiny = load_preset("tiny")
    assert "start_source" not in tiny.to_dict()["sampler"] and JobConfig.from_dict(tiny.to_dict()) == tiny
    mix = tiny.replace(sampler={"start_sigma": 1.0, "start_source": "mix"})
    assert mix.to_dict()["sampler"]["start_source"] == "mix" and JobConfig.from_dict(mix.to_dict()) == mix


def test_an_unknown_start_source_is_refused_naming_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match="start_source: 'noise' is not one of 'central', 'aux', 'mix'"):
        job(sampler={"start_source": "noise", "start_sigma": 1.0})


@pytest.mark.parametrize("source", ["aux", "mix"])
def test_aux_and_mix_need_start_sigma(source: str) -> None:
    with pytest.raises(ConfigError, match=f'start_source = "{source}" needs start_sigma'):
        job(frequency=FREQ, sampler={"start_source": source})


@pytest.mark.parametrize("source", ["aux", "mix"])
def test_aux_and_mix_need_the_frequency_stage(source: str) -> None:
    with pytest.raises(ConfigError, match=r"only the frequency stage fits: set \[frequency\] sigma"):
        job(sampler={"start_source": source, "start_sigma": 1.0})  # frequency off by default
    with pytest.raises(ConfigError, match="only the frequency stage fits"):  # a method that switches it off
        job(job={"method": "dp-feta"}, frequency=FREQ, sampler={"start_source": source, "start_sigma": 1.0})


def test_mix_needs_central_images_but_aux_does_not() -> None:
    with pytest.raises(ConfigError, match=r'"mix" takes half its starts from the released central images'):
        job(central={"rounds": 0}, frequency=FREQ, sampler={"start_source": "mix", "start_sigma": 1.0})
    cfg = job(central={"rounds": 0}, frequency=FREQ, sampler={"start_source": "aux", "start_sigma": 1.0})
    assert cfg.sampler.start_source == "aux"


# -- the starts
# -----------------------------------------------------------------------------------------------


def test_mix_alternates_within_each_class() -> None:
    """Even index within its class: aux (the set's labels are interleaved, so position parity would give whole
    classes to one source when the class count is even)."""
    labels = np.tile(np.arange(10), 3)
    take = aux_taken(labels, "mix")
    for c in range(10):
        assert take[labels == c].tolist() == [True, False, True]
    assert aux_taken(labels, "aux").all()


def test_mix_takes_aux_generator_images_where_taken_and_central_starts_elsewhere() -> None:
    aux, (x, y) = _aux(), bars(3)
    labels = np.array([0, 1, 1, 0, 1, 0, 0])
    take = aux_taken(labels, "mix")
    cfg = job(warmup={"augment_magnitude": 1})
    central = sdedit_starts((x.numpy(), y.numpy()), labels, cfg, torch.Generator().manual_seed(0))
    seen: list = []
    real = aux.forward

    def spy(z: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        seen.append(lab.clone())
        return real(z, lab)

    aux.forward = spy  # type: ignore[method-assign]
    got = aux_starts(aux, labels, take, central, torch.Generator().manual_seed(5))
    # the aux generator drew the taken starts' labels
    assert torch.equal(seen[0], torch.from_numpy(labels[take]))
    assert torch.equal(got[~torch.from_numpy(take)], central[~torch.from_numpy(take)])
    want = aux_draw(aux, labels[take], torch.Generator().manual_seed(5))
    assert torch.equal(got[torch.from_numpy(take)], want) and got.min() >= 0 and got.max() <= 1
    only = aux_starts(aux, labels, aux_taken(labels, "aux"), None, torch.Generator().manual_seed(5))
    assert torch.equal(seen[-1], torch.from_numpy(labels)) and only.shape == (7, 1, 16, 16)
    with pytest.raises(DataError, match="no released central images for the other half"):
        aux_starts(aux, labels, take, None, torch.Generator())


def test_the_pool_is_public_count_per_class_and_seeded_by_the_job() -> None:
    aux, cfg = _aux(3), job(job={"seed": 4})
    images, labels = aux_pool(aux, cfg)
    assert np.bincount(labels).tolist() == [AUX_POOL_PER_CLASS] * 3 and labels.dtype == np.int64
    assert images.dtype == np.float32 and images.shape == (3 * AUX_POOL_PER_CLASS, 1, 16, 16)
    assert images.min() >= 0 and images.max() <= 1
    again, _ = aux_pool(aux, cfg)
    other, _ = aux_pool(aux, job(job={"seed": 5}))
    assert np.array_equal(images, again) and not np.array_equal(images, other)


def _spied_run(tmp_path, monkeypatch, cfg, name: str) -> tuple[list, list, np.lib.npyio.NpzFile]:  # noqa: ANN001
    inits: list = []
    drawn: list = []
    real_generate, real_draw = synthesis.generate, synthesis.aux_draw

    def gen_spy(model, labels, seed, scfg, **kw):  # noqa: ANN001, ANN202
        inits.append((np.asarray(labels).copy(), scfg.sigma_max, kw.get("init")))
        return real_generate(model, labels, seed, scfg, **kw)

    def draw_spy(aux, labels, generator):  # noqa: ANN001, ANN202
        out = real_draw(aux, labels, generator)
        drawn.append((np.asarray(labels).copy(), out))
        return out

    monkeypatch.setattr(synthesis, "generate", gen_spy)
    monkeypatch.setattr(synthesis, "aux_draw", draw_spy)
    run_pipeline(cfg, _data(), tmp_path / name, n_synthetic=30, grid_per_class=1, noise_seed=1)
    return inits, drawn, np.load(tmp_path / name / "synthetic.npz")


@pytest.mark.slow  # two tiny runs
def test_a_mix_run_starts_even_positions_from_the_aux_generator_and_writes_its_pool(
    tmp_path, monkeypatch
) -> None:
    cfg = load_preset("tiny").replace(sampler={"start_sigma": 1.0, "start_source": "mix"})
    inits, drawn, z = _spied_run(tmp_path, monkeypatch, cfg, "mix")
    labels, sigma_max, init = inits[-1]
    assert sigma_max == 1.0 and init is not None and tuple(init.shape) == (30, 1, 28, 28)
    take = torch.from_numpy(aux_taken(labels, "mix"))
    # the aux generator's labels
    assert take.sum() == 20 and np.array_equal(drawn[0][0], labels[take.numpy()])
    assert torch.equal(init[take], drawn[0][1])
    assert np.bincount(z["labels"]).tolist() == [3] * 10
    with np.load(tmp_path / "mix" / "released" / "aux_images.npz") as pool:
        assert np.bincount(pool["labels"]).tolist() == [AUX_POOL_PER_CLASS] * 10
    # the default draws as before: no aux generator, no pool, the central starts of the same stream
    cfg0 = load_preset("tiny").replace(sampler={"start_sigma": 1.0})
    inits0, drawn0, _ = _spied_run(tmp_path, monkeypatch, cfg0, "central")
    assert not drawn0 and not (tmp_path / "central" / "released" / "aux_images.npz").exists()
    assert torch.equal(inits0[-1][2][~take], init[~take])  # the rest: the same augmented central images


def test_trained_aux_loads_the_checkpoint_when_the_stage_was_skipped(tmp_path) -> None:
    from types import SimpleNamespace

    from feta_release.ledger import Ledger
    from feta_release.planning import plan
    from feta_release.signing import generate_keypair, load_private_key
    from feta_release.stages import RunAccount, run_budget
    from feta_release.stages.context import RunDir, save_checkpoint

    aux = _aux(10, 28)
    cfg = job(auxgen={"z_dim": 4, "width": 4})
    rd = RunDir(tmp_path)
    key = load_private_key(generate_keypair(tmp_path / "keys", "site")[0])
    account = RunAccount(
        Ledger(tmp_path / "ledger.sqlite", key=key),
        "job",
        plan(cfg, 60000),
        run_budget(cfg),
        tmp_path / "privacy.json",
    )
    save_checkpoint(SimpleNamespace(rd=rd, account=account), "auxgen.pt", {"model": aux.state_dict()})
    ctx = SimpleNamespace(
        aux=None,
        rd=rd,
        cfg=cfg,
        data=SimpleNamespace(image_shape=(1, 28, 28), n_classes=10),
        device=torch.device("cpu"),
        account=account,
    )
    got = freq_warmup.trained_aux(ctx)  # type: ignore[arg-type]
    assert ctx.aux is got
    lab = np.arange(10)
    assert torch.equal(
        aux_draw(got, lab, torch.Generator().manual_seed(1)),
        aux_draw(aux, lab, torch.Generator().manual_seed(1)),
    )


def test_the_ledger_binds_the_pool_synthesis_drew_not_a_file_swapped_before_the_close(
    tmp_path, monkeypatch
) -> None:
    """Review (aux pool, medium): the closed ledger record's pool hash was a RE-READ of
    released/aux_images.npz after model.pt, privacy.json and the chart were written, so a local user who
    swapped the file in that window (e.g. for private images) got it into the signed release. Now it is the
    hash of the bytes Synthesis wrote."""
    import hashlib

    from feta_release.stages.account import RunAccount
    from feta_release.training import pipeline

    seen: dict[str, str | None] = {}
    real_chart, real_close = pipeline._budget_chart, RunAccount.close

    def chart_then_swap(doc, path):  # noqa: ANN001, ANN202
        real_chart(doc, path)
        pool = path.parent / "released" / "aux_images.npz"
        seen["drawn"] = hashlib.sha256(pool.read_bytes()).hexdigest()
        with np.load(pool) as z:
            arrays = dict(z)
        np.savez(pool, **{**arrays, "images": np.ones_like(arrays["images"])})  # stands in for private images
        seen["swapped"] = hashlib.sha256(pool.read_bytes()).hexdigest()

    def close(self, job_sha256, model_sha256, aux_pool_sha256=None):  # noqa: ANN001, ANN202
        seen["closed"] = aux_pool_sha256
        return real_close(self, job_sha256, model_sha256, aux_pool_sha256)

    monkeypatch.setattr(pipeline, "_budget_chart", chart_then_swap)
    monkeypatch.setattr(RunAccount, "close", close)
    cfg = load_preset("tiny").replace(sampler={"start_sigma": 1.0, "start_source": "mix"})
    run_pipeline(cfg, _data(), tmp_path / "run", n_synthetic=10, grid_per_class=1, noise_seed=1)
    assert seen["drawn"] != seen["swapped"]
    assert seen["closed"] == seen["drawn"], "the ledger recorded the swapped file's hash"
