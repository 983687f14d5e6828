"""On-the-fly training decodes and encodes each window once (data.frame_store_mib, data.encoded_store_mib) and
trains exactly what it trains without keeping anything."""

from __future__ import annotations

import torch

from vidtune.data.encoded_store import EncodedStore
from vidtune.trainers import build_trainer


def test_the_encoded_store_computes_only_missing_entries_and_keeps_to_its_size():
    calls: list[list[int]] = []

    def encode(picks: list[int]) -> list[dict[str, torch.Tensor]]:
        calls.append(picks)
        return [{"x": torch.full((4,), float(p))} for p in picks]  # 16 bytes an entry

    store = EncodedStore(budget_bytes=32)
    first = store.items(["a", "b", "c"], encode)
    again = store.items(["c", "a", "b"], encode)
    # Each entry encoded alone (its values never depend on its batch mates); "c" did not fit: computed again.
    assert calls == [[0], [1], [2], [0]]
    assert [e["x"][0].item() for e in first] == [0, 1, 2]
    assert [e["x"][0].item() for e in again] == [0, 0, 1]
    assert (store.stored_bytes, store.hits, store.misses) == (32, 2, 4)


def test_later_epochs_encode_nothing_and_train_what_encoding_every_visit_trains(make_config, tmp_path):
    def run(name: str, **data):
        config = make_config("ltx-video", training={"steps": 8}, output_dir=str(tmp_path / name),
                             data={"num_workers": 0, **data})
        trainer = build_trainer(config)
        return trainer, trainer.run().losses

    kept, kept_losses = run("kept")
    plain, plain_losses = run("plain", frame_store_mib=0, encoded_store_mib=0)
    assert kept_losses == plain_losses
    windows = len(kept.context.clips)  # frame_sampling=start: one window a clip; 8 steps are two epochs of 4 clips
    encoded = kept.context.source.encoded
    assert (encoded.misses, encoded.hits) == (2 * windows, 2 * windows)  # captions + windows
    assert plain.context.source.store is None and plain.context.source.encoded.hits == 0
