"""The torchrun backend: torch's elastic agent subclassed, its workers' endings turned into the
policy's evidence, its restarts and its standby agents on spare nodes."""
