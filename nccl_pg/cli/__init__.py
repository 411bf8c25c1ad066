"""The commands: nccl-pg run|store|bench|trace|doctor, the launcher and the demo job."""
