"""Multi-host launch: distributed initialization and launchers (uses the public API only).

Modules: `distributed` (initialize(), the cross-process input check; the environment
contract is written down in README.md, "Multi-host launch"), `local` (N processes on this
machine), `tpu` (gcloud fan-out over a TPU VM slice), `cli` (`ringflash launch`), `check`
(`ringflash check`), and the training job `train` (`ringflash train`) with its `model`,
`data` and `checkpointing`. Nothing is imported or initialized here.
"""
