"""Pure policies: retention (which checkpoints to keep, and deleting the rest), and triggers
(when to save). Clocks are injected."""
