"""An nnrun folder as SAELens's cached-activations input: the format (no SAELens import), and a real SAELens run.

sae-lens is an optional extra (`nnrun[sae]`: it pulls transformer-lens, wandb, ...), not part of
the test install: the round trip runs where it is installed, and the format check always runs.
"""

from __future__ import annotations

import pytest
import torch
from ray_helpers import MODEL, job_prompts

from nnrun.distributed.saelens import export_saelens
from nnrun.extract import extract, load_activations

MODULE = "model.layers.2"
CONTEXT = 16


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("sae")
    extract(MODEL, job_prompts(40, seed=2), [MODULE], out / "acts", shard_tokens=200, progress=False)
    return out / "acts", export_saelens(out / "acts", MODULE, out / "cache", context_size=CONTEXT, contexts_per_write=7)


def test_format_is_what_saelens_loads(exported):
    import datasets

    folder, export = exported
    store = load_activations(folder)
    # What SAELens's ActivationsStore.load_cached_activation_dataset does and checks, without importing it.
    dataset = datasets.load_from_disk(export.path)
    assert export.hook_name in dataset.column_names and "token_ids" in dataset.column_names
    assert dataset.features[export.hook_name].shape == (CONTEXT, 192)
    assert dataset.features["token_ids"].length == CONTEXT
    dataset.set_format(type="torch", columns=[export.hook_name, "token_ids"], dtype=torch.float32)
    activations = dataset[0 : len(dataset)][export.hook_name]  # [contexts, CONTEXT, d_in]
    token_ids = dataset[0 : len(dataset)]["token_ids"]

    rows = torch.cat([store[i][MODULE] for i in range(len(store))])  # the folder's tokens in input order
    ids = torch.cat([store[i].token_ids for i in range(len(store))])
    num_kept = export.num_contexts * CONTEXT
    assert (
        export.num_contexts == store.num_tokens // CONTEXT and export.num_dropped_tokens == store.num_tokens - num_kept
    )
    assert torch.equal(activations.reshape(-1, 192), rows[:num_kept])
    assert torch.equal(token_ids.reshape(-1).to(torch.int32), ids[:num_kept])


def test_saelens_trains_an_sae_from_an_nnrun_folder(exported):
    pytest.importorskip("sae_lens")
    from sae_lens import StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.activations_store import ActivationsStore
    from sae_lens.training.sae_trainer import SAETrainer

    _, export = exported
    num_steps, batch = 4, 32
    store = ActivationsStore(
        model=None,
        dataset=None,
        streaming=False,
        hook_name=export.hook_name,
        hook_head_index=None,
        context_size=CONTEXT,
        d_in=export.d_in,
        n_batches_in_buffer=2,
        total_training_tokens=num_steps * batch,
        store_batch_size_prompts=4,
        train_batch_size_tokens=batch,
        prepend_bos=False,
        normalize_activations="none",
        device=torch.device("cpu"),
        dtype="float32",
        cached_activations_path=export.path,
    )
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=export.d_in, d_sae=64, dtype="float32", device="cpu"))
    before = sae.W_enc.detach().clone()
    trainer = SAETrainer(
        SAETrainerConfig(
            total_training_samples=num_steps * batch,
            train_batch_size_samples=batch,
            lr_end=3e-4,
            n_batches_for_norm_estimate=1,
        ),
        sae,
        data_provider=store,
    )
    trainer.fit()
    assert trainer.n_training_steps == num_steps
    assert not torch.equal(sae.W_enc, before)
