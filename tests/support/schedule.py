"""The order in which `pytest -n N --dist loadfile` hands out the test files: longest first.

xdist runs each file whole on one worker and, by default, hands the files out by their number
of tests, most first, so the long files of one or two tests (the soak, the service processes,
the load balancer) come last and one worker runs them while the other has nothing left.
Handed out longest first, the short files at the end fill the gaps instead: the run ends
about when half the total work is done.

`COST_S` is what each long file took one worker, in seconds, in a full run on a 2-core
machine (AMD EPYC, 2026-11-30); a file not listed counts as short and keeps xdist's order
among the other short ones. A stale figure only makes the run slower, never wrong.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

#: Seconds of one worker per file (the long ones), measured with `-n 2 --dist loadfile` on 2 cores.
COST_S: dict[str, float] = {
    "tests/gateway/test_sampling.py": 80,
    "tests/specdec/model/test_llama_parity.py": 65,
    "tests/gateway/test_faults.py": 65,
    "tests/gateway/test_soak.py": 60,
    "tests/gateway/test_structured_output.py": 45,
    "tests/gateway/test_streaming.py": 40,
    "tests/gateway/test_cli.py": 40,
    "tests/gateway/test_greedy_parity.py": 30,
    "tests/gateway/test_leases.py": 25,
    "tests/draft_server/test_guesses.py": 25,
    "tests/specdec/serving/test_service_processes.py": 20,
    "tests/specdec/model/test_quantize_int4.py": 20,
    "tests/gateway/test_openai_front.py": 20,
    "tests/gateway/test_lookup_drafting.py": 20,
    "tests/gateway/test_logprobs.py": 20,
    "tests/gateway/test_kv_handoff.py": 20,
    "tests/gateway/test_errors.py": 20,
    "tests/gateway/test_balancer.py": 20,
    "tests/gateway/test_admission.py": 20,
    "tests/target_server/test_target_service.py": 15,
    "tests/target_server/test_keepalive.py": 15,
    "tests/target_server/test_batch_invariant.py": 15,
    "tests/specdec/tuning/test_compiled_layers.py": 15,
    "tests/gateway/test_shared_admission.py": 15,
    "tests/gateway/test_random_model_stack.py": 15,
    "tests/gateway/test_prometheus_e2e.py": 15,
    "tests/gateway/test_metrics.py": 15,
    "tests/gateway/test_fuzz.py": 15,
    "tests/gateway/test_adaptive_from_the_first_second.py": 15,
    "tests/draft_server/test_draft_service.py": 15,
    "tests/unit/kv_cache/test_block_manager.py": 10,
    "tests/specdec/tuning/test_openmp_binding.py": 10,
    "tests/gateway/test_drain.py": 10,
}


class LongestFileFirst(LoadFileScheduling):
    """`--dist loadfile`, each worker given the longest file still waiting (by `COST_S`)."""

    def _assign_work_unit(self, node: WorkerController) -> None:
        # `max` keeps the first of equals: the unlisted files stay in xdist's order.
        longest = max(self.workqueue, key=lambda scope: COST_S.get(scope, 0.0))
        self.workqueue.move_to_end(longest, last=False)
        super()._assign_work_unit(node)
