"""The srun backend: the training as srun steps on the allocation's nodes, a failed step's tasks
turned into the policy's evidence, the step relaunched in place on a spare node."""
