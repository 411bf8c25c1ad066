"""The group layer: ProcessGroup's parts, by responsibility (core, issuing,
collectives), and its options. See docs/ARCHITECTURE.md."""
