"""Run in a generated llama or custom project (cwd, on PYTHONPATH) by test_document_masking.py: one process, no
FSDP, fp32. Prints JSON about the first training batch of data.path (argv[1]; the rest: config overrides):

- packed: the loss of the packed batch (model.py's loss with the batch's positions and document ids);
- alone: the token-weighted mean of the losses of its documents, each run by itself, unpacked;
- kept / changed: the largest change of the logits of a window's last document when the document before it is
  replaced by other tokens of the same length, with data.document_mask on and off.
"""

import json
import sys

import torch
from config import load_config
from data import IGNORE, micro_batches, open_tokens
from model import build_model, loss, output_logits

path, overrides = sys.argv[1], sys.argv[2:]
pairs = zip(overrides[::2], overrides[1::2], strict=True)
config = load_config("config.toml", {key.removeprefix("--"): value for key, value in pairs})
torch.manual_seed(0)
model = build_model(config)
model.init_weights(seed=0)
model.eval()
seq_len, batch_size = config.training.seq_len, config.training.global_batch_size


def first_batch(document_mask: bool):
    samples = open_tokens(path, "train", seq_len, config.model.vocab_size, document_mask)
    [batch] = micro_batches(samples, 0, batch_size, 1, 0, 1)
    return batch


with torch.no_grad():
    batch = first_batch(True)
    packed = loss(model, *batch, chunks=1).item()
    total, counted, documents = 0.0, 0, 0
    for row in range(batch.inputs.shape[0]):
        for document in batch.document_ids[row].unique():
            where = batch.document_ids[row] == document
            inputs, targets = batch.inputs[row][where][None], batch.targets[row][where][None]
            # Alone: no positions, no document ids: plain causal attention from position 0.
            total += loss(model, inputs, targets, reduction="sum", chunks=1).item()
            counted += int((targets != IGNORE).sum())
            documents += 1

    # A window with at least three documents: replace the one before its last.
    row = int(torch.argmax(batch.document_ids[:, -1]))
    last = batch.document_ids[row, -1]
    before = batch.document_ids[row] == last - 1
    changed_inputs = batch.inputs.clone()
    changed_inputs[row][before] = (changed_inputs[row][before] + 1) % config.model.vocab_size

    def change(batch) -> float:
        logits = output_logits(model(batch.inputs, batch.positions, batch.document_ids))
        other = output_logits(model(changed_inputs, batch.positions, batch.document_ids))
        mine = batch_ids == last
        return (logits[row][mine] - other[row][mine]).abs().max().item()

    batch_ids = batch.document_ids[row]
    kept = change(batch)
    unmasked = first_batch(False)
    assert unmasked.positions is None and unmasked.document_ids is None
    changed = change(unmasked)

print(json.dumps({"packed": packed, "alone": total / counted, "documents": documents, "targets": counted,
                  "ignored": int((batch.targets == IGNORE).sum()), "kept": kept, "changed": changed,
                  "before_length": int(before.sum()), "last_document": int(last)}))  # fmt: skip
