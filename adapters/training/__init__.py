"""Training the embedded model (docs/training.md).

* `keys.TrainKeys`: the `KeySource` of a batch of whole sequences, differentiable, with the
  reference's semantics (`adapters.model.reference.DenseKeys`): window, compressed entries, the C4
  indexer's top-k, the sink; it also computes the indexer's auxiliary KL loss.
* `forward.train_forward`: the runner's layer skeleton (`adapters.model.model`) and MTP block
  (`adapters.forward.mtp`) over `TrainKeys`; the losses.
* `loop`: batches, the optimiser, evaluation (bits per byte), checkpoints.

The CLI is ``python -m adapters.train``.
"""
