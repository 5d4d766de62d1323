"""swarmtrain.integrations.huggingface: two transformers.Trainer peers (threads, real DHTs on
loopback) train a tiny masked LM with a WordPiece tokenizer trained here, in lockstep."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from swarmtrain.dht import DHT
from swarmtrain.optim import Optimizer
from swarmtrain.utils.background import BackgroundRuntime

transformers = pytest.importorskip("transformers")  # CI installs the hf extra (.ci/run)
pytest.importorskip("accelerate")
tokenizers = pytest.importorskip("tokenizers")

from swarmtrain.integrations.huggingface import (  # noqa: E402
    SwarmScheduler,
    TrainerOptimizer,
    make_collaborative,
)

HOST = {"use_relay": False, "relay_service": False, "use_autonat": False}
FAST = {
    "matchmaking_time": 1.0,
    "averaging_timeout": 15.0,
    "load_state_timeout": 15.0,
    "tracker_opts": {"gossip_period": 0.1, "min_refresh_period": 0.2},
}
SEQ, BATCH = 12, 8
NOUNS = ["cat", "dog", "bird", "fish", "horse", "mouse", "sheep", "goat"]
VERBS = ["sees", "chases", "likes", "feeds", "follows", "hears"]


def corpus(count: int, seed: int = 0) -> list[str]:
    """Sentences of a tiny grammar: ``the <noun> <verb> the <noun> .`` (learnable structure)."""
    rng = random.Random(seed)
    return [
        f"the {rng.choice(NOUNS)} {rng.choice(VERBS)} the {rng.choice(NOUNS)} ."
        for _ in range(count)
    ]


def train_tokenizer() -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    trainer = tokenizers.trainers.WordPieceTrainer(
        vocab_size=120, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    )
    tokenizer.train_from_iterator(corpus(200, seed=1), trainer=trainer)
    return tokenizer


def masked_dataset(tokenizer: tokenizers.Tokenizer, count: int, seed: int) -> list[dict]:
    """Fixed MLM examples: one content word of each sentence masked (no collator randomness)."""
    cls, sep, pad, mask = (tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]"))
    rng = random.Random(seed)
    examples = []
    for text in corpus(count, seed):
        ids = [cls, *tokenizer.encode(text).ids, sep]
        assert len(ids) == 8, tokenizer.encode(text).tokens  # whole words: the vocab holds them
        ids += [pad] * (SEQ - len(ids))
        position = rng.choice([2, 3, 5])  # a noun or the verb
        labels = [-100] * SEQ
        labels[position], ids[position] = ids[position], mask
        examples.append(
            {
                "input_ids": torch.tensor(ids),
                "attention_mask": torch.tensor([int(i != pad) for i in ids]),
                "labels": torch.tensor(labels),
            }
        )
    return examples


def tiny_bert(vocab_size: int) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every peer
    config = transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


def eval_loss(model: torch.nn.Module, examples: list[dict]) -> float:
    batch = {key: torch.stack([e[key] for e in examples]) for key in examples[0]}
    model.eval()
    with torch.no_grad():
        loss = model(**batch).loss.item()
    model.train()
    return loss


class StopAtEpoch(transformers.TrainerCallback):
    """Stops Trainer when the swarm optimizer reaches ``epoch``; snapshots each epoch's model."""

    def __init__(self, opt: Optimizer, model: torch.nn.Module, epoch: int):
        self.opt, self.model, self.epoch = opt, model, epoch
        self.snapshots: dict[int, list[torch.Tensor]] = {}

    def on_step_end(self, args, state, control, **kwargs):
        epoch = self.opt.local_epoch
        if epoch not in self.snapshots:
            self.snapshots[epoch] = [p.detach().clone() for p in self.model.parameters()]
        if epoch >= self.epoch:
            control.should_training_stop = True


@pytest.fixture
def dhts() -> Iterator[Callable[[int], list[DHT]]]:
    made: list[DHT] = []

    def make(n: int) -> list[DHT]:
        for _ in range(n):
            made.append(DHT(made[0].get_visible_maddrs() if made else [], **HOST))
        return made[-n:]

    yield make
    for dht in reversed(made):
        dht.shutdown()
    assert BackgroundRuntime.active_references() == 0


def make_trainer(model, dataset, output_dir, **args) -> transformers.Trainer:
    training_args = transformers.TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=args.pop("per_device_train_batch_size", BATCH),
        max_steps=args.pop("max_steps", 200),  # StopAtEpoch ends training earlier
        logging_steps=1,
        save_strategy=args.pop("save_strategy", "no"),
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        **args,
    )
    return transformers.Trainer(model=model, args=training_args, train_dataset=dataset)


def swarm_optimizer(dht: DHT, model: torch.nn.Module, **opts) -> Optimizer:
    return Optimizer(
        dht=dht,
        run_id="hf_mlm",
        target_batch_size=opts.pop("target_batch_size", 32),
        params=model.parameters(),
        optimizer=lambda params: torch.optim.Adam(params, lr=2e-2),
        delay_state_averaging=False,  # lockstep: peers agree exactly after each epoch
        **{**FAST, **opts},
    )


def test_two_trainer_peers_learn_in_lockstep(dhts, tmp_path):
    tokenizer = train_tokenizer()
    held_out = masked_dataset(tokenizer, 64, seed=99)
    peers = []
    try:
        for index, dht in enumerate(dhts(2)):
            model = tiny_bert(tokenizer.get_vocab_size())
            opt = swarm_optimizer(dht, model)
            trainer = make_trainer(
                model, masked_dataset(tokenizer, 256, seed=index), tmp_path / str(index), seed=index
            )
            callback = make_collaborative(trainer, opt)
            stop = StopAtEpoch(opt, model, epoch=4)
            trainer.add_callback(stop)
            peers.append((model, opt, trainer, callback, stop))
        initial = eval_loss(peers[0][0], held_out)
        assert isinstance(peers[0][2].optimizer, TrainerOptimizer)
        assert isinstance(peers[0][2].lr_scheduler, SwarmScheduler)
        with ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(p[1].wait_for_peers, 2, 20) for p in peers]:
                assert future.result(timeout=30) == 2
            results = [pool.submit(p[2].train) for p in peers]
            for future in results:
                future.result(timeout=90)

        opts = [p[1] for p in peers]
        assert {opt.local_epoch for opt in opts} == {4}
        assert all(opt.epochs_averaged >= 2 for opt in opts)
        common = set(peers[0][4].snapshots) & set(peers[1][4].snapshots)
        assert {1, 2, 3, 4} <= common
        final = eval_loss(peers[0][0], held_out)
        assert final < 0.75 * initial, (initial, final)
        # whatever rounds failed on the way (logged), the second peer's download of the first's
        # state (uncompressed) leaves both with the same parameters and epoch
        assert opts[1].load_state_from_peers(timeout=30)
        assert opts[1].local_epoch == opts[0].local_epoch == 4
        for a, b in zip(peers[0][0].parameters(), peers[1][0].parameters(), strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)

        # the callback tried to load the state at train start (the peers start equal) and logged the
        # swarm's progress into Trainer's log history
        for _, _, trainer, callback, _ in peers:
            assert callback.loaded_state_from_peers is not None  # tried at train start
            logged = [entry for entry in trainer.state.log_history if "loss" in entry]
            assert logged and all("swarm_epoch" in entry for entry in logged)
            assert max(entry["swarm_peers"] for entry in logged) == 2
            assert logged[-1]["swarm_epoch"] >= 3
    finally:
        for peer in peers:
            peer[1].shutdown()


def test_importing_swarmtrain_imports_no_framework():
    code = (
        "import sys, swarmtrain, swarmtrain.integrations, swarmtrain.optim; "
        "print(sorted(m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()
    assert out == "[]"


def with_loss_scaler(
    trainer: transformers.Trainer, precision: str, **scaler_args: Any
) -> transformers.Trainer:
    """fp16: accelerate gives Trainer a GradScaler on GPUs only; on CPU install one the same way
    (``native_amp``: it unscales before clipping), so the scaler's path through the adapter runs
    (loss scaled, gradients unscaled in place, step skipped on inf, scale updated)."""
    if precision == "fp16" and trainer.accelerator.scaler is None:
        scaler_args = {"init_scale": 2.0**10, **scaler_args}
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", **scaler_args)
        trainer.accelerator.native_amp = True
    return trainer


def test_fp16_steps_that_overflow_are_skipped_and_not_counted(dhts, tmp_path):
    """CPU fp16 autocast with a loss scale far too large: the first steps' gradients overflow,
    the scaler skips them before the adapter (no samples reported, nothing accumulated, the
    scale halves each time); then training goes on with finite parameters and counts each
    step that was taken."""
    tokenizer = train_tokenizer()
    (dht,) = dhts(1)
    model = tiny_bert(tokenizer.get_vocab_size())
    opt = swarm_optimizer(dht, model, target_batch_size=16)
    steps, init_scale = 14, 2.0**20
    try:
        trainer = make_trainer(
            model,
            masked_dataset(tokenizer, 256, seed=0),
            tmp_path,
            per_device_train_batch_size=4,
            max_steps=steps,
            fp16=True,
        )
        with_loss_scaler(trainer, "fp16", init_scale=init_scale, growth_interval=10**6)
        adapter = make_collaborative(trainer, opt, load_state_from_peers=False).optimizer
        trainer.train()
        scale = trainer.accelerator.scaler.get_scale()
        skipped = round(math.log2(init_scale / scale))  # halved once per skipped step, never grown
        assert 1 <= skipped < steps, scale
        assert adapter.samples_stepped == (steps - skipped) * 4
        assert opt.local_samples_accumulated + 16 * opt.local_epoch == (steps - skipped) * 4
        assert opt.skipped_batches == 0  # the scaler dropped them: the swarm never saw an inf
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        opt.shutdown()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_accumulation_mixed_precision_and_checkpoint_resume(dhts, tmp_path, precision):
    """One peer: Trainer's gradient accumulation reports every micro-batch's samples; AMP's
    scaler works through the adapter; a checkpoint holds the swarm state and a resumed run
    continues from it (not from the new process's initial parameters)."""
    tokenizer = train_tokenizer()
    dataset = masked_dataset(tokenizer, 256, seed=0)
    held_out = masked_dataset(tokenizer, 64, seed=99)
    (dht,) = dhts(1)
    amp = {precision: True}
    model = tiny_bert(tokenizer.get_vocab_size())
    initial = eval_loss(model, held_out)
    opt = swarm_optimizer(dht, model, target_batch_size=16)
    try:
        trainer = make_trainer(
            model,
            dataset,
            tmp_path,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=8,
            save_strategy="steps",
            save_steps=8,
            **amp,
        )
        with_loss_scaler(trainer, precision)
        adapter = make_collaborative(trainer, opt).optimizer
        trainer.train()
        assert adapter.samples_stepped == 8 * 2 * 4  # every micro-batch counted
        assert opt.local_epoch == 4  # 64 samples, 16 per epoch: one epoch per 2 Trainer steps
        if precision == "fp16":
            scaler = trainer.accelerator.scaler
            assert scaler._scale is not None  # the losses were scaled
            assert 0 < scaler.get_scale() < float("inf")
        trained = eval_loss(model, held_out)
        assert trained < 0.85 * initial, (initial, trained)
        params = [p.detach().clone() for p in model.parameters()]
    finally:
        opt.shutdown()

    torch.manual_seed(1)
    fresh = tiny_bert(tokenizer.get_vocab_size())
    for p in fresh.parameters():  # another start: the resumed run must not come back to it
        p.data.add_(torch.randn_like(p))
    opt = swarm_optimizer(dht, fresh, target_batch_size=16)
    try:
        trainer = make_trainer(
            fresh,
            dataset,
            tmp_path,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=10,
            save_strategy="no",
            **amp,
        )
        with_loss_scaler(trainer, precision)
        callback = make_collaborative(trainer, opt)
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-8"))
        assert callback.loaded_state_from_peers is False  # alone: the checkpoint's state stays
        assert opt.local_epoch == 5  # 4 from the checkpoint, one more in 2 steps
        assert opt.state_dict()["state"], "the optimizer's statistics were restored"
        pairs = zip(params, fresh.parameters(), strict=True)
        drift = max((a - b).abs().max().item() for a, b in pairs)
        assert drift < 0.2, drift  # went on from the checkpoint's parameters
        assert eval_loss(fresh, held_out) < 0.85 * initial
    finally:
        opt.shutdown()


def test_diloco_under_trainer(dhts, tmp_path):
    """The adapter drives a DiLoCoOptimizer too: Trainer's steps are its inner steps, its outer
    rounds run every ``inner_steps`` (one peer here, groups of one: the wiring, not the swarm;
    DiLoCo's swarm behaviour is tested in test_optim_diloco.py)."""
    from swarmtrain.optim import DiLoCoOptimizer

    tokenizer = train_tokenizer()
    held_out = masked_dataset(tokenizer, 64, seed=99)
    (dht,) = dhts(1)
    model = tiny_bert(tokenizer.get_vocab_size())
    initial = eval_loss(model, held_out)
    opt = DiLoCoOptimizer(
        model.parameters(),
        dht=dht,
        run_id="hf_diloco",
        inner_steps=4,
        inner_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        min_group_size=1,
        matchmaking_time=0.5,
        averaging_timeout=10.0,
    )
    try:
        trainer = make_trainer(model, masked_dataset(tokenizer, 256, seed=0), tmp_path, max_steps=8)
        adapter = make_collaborative(trainer, opt, load_state_from_peers=False).optimizer
        trainer.train()
        opt.wait_for_pending_rounds()
        assert opt.inner_step == 8 and opt.outer_step == 2
        assert adapter.samples_stepped == 8 * BATCH
        assert eval_loss(model, held_out) < 0.85 * initial
        logged = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert logged[-1]["swarm_epoch"] == opt.local_epoch
    finally:
        opt.shutdown()
