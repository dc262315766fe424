"""The local backend: ranks started on this machine (warm, forked from one process that imported
torch), their exit codes turned into the policy's evidence, relaunched while it says so."""
