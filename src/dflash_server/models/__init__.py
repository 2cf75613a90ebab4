"""The target model as DFlash drives it: its parts and hooks, the Gated DeltaNet recurrence,
multimodal positions, the vision tower, and loading checkpoints."""
