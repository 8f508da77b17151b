"""Gateway: streaming Generate, the speculative accept/reject loop and the scheduler."""
