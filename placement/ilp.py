"""The placement ILP (PuLP + its bundled CBC): minimise the modeled time per decoded token.

Dense layers choose one of three modes (binary ``layer_all_cpu[i]``, ``layer_all_gpu[i]``,
``layer_mixed[i]``, exactly one); only the mixed mode pays the CPU/GPU synchronisation. Inside the
mixed mode each unit has its own binary bounded by ``layer_mixed[i]``: ``attention_on_gpu_mixed[i]``,
``predictor_on_gpu_mixed[i]``, ``chunk_on_gpu_mixed[i][c]`` (FFN neuron chunks, hottest first),
with the minimum-or-none rule ``sum(chunk neurons) >= min_gpu_neurons * (layer's FFN uses the GPU)``
and the continuous ``ffn_time_mixed_us[i]`` >= the GPU FFN time and >= the CPU FFN time (the two
run concurrently: the layer's FFN costs their maximum). This disjunctive form makes the LP
relaxation the convex hull of the three modes, so CBC proves optimality quickly. MoE layers pick
one ``moe_choice[i][attention][shared expert][expert option]`` (expert option = pinned count x LRU
cache slots), each priced exactly by ``cost_model.evaluate_layer``. Once per model:
``output_head_on_gpu``, ``embeddings_on_gpu``. Objective in microseconds; one budget constraint
over the placed bytes (in MiB) left after buffers.

The greedy placement warm-starts CBC, and whatever the solver returns is re-scored with
``cost_model.evaluate_placement``: if it is worse than greedy (or breaks a rule), greedy is kept.

Example::

    result = solve_placement(problem, greedy_placement(problem), SolverSettings(time_limit_s=30))
    result.status, result.gap_rel, result.placement
"""
from __future__ import annotations

import re
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pulp

from tandem.core.errors import TandemError

from .cost_model import Placement, evaluate_layer, evaluate_placement
from .hardware import MiB
from .problem import PlacementProblem


def release_pulp_import_frames() -> int:
    """Drop the tracebacks of the exceptions pulp keeps from its optional solvers' failed imports
    (``COPT_DLL.err``, ``CPLEX_PY.err``: the library is absent). Each traceback holds every frame that was on
    the stack when pulp was first imported, with its locals: under ``tandem plan`` that was the frame holding
    the float32 checkpoint (4.3 GB for a 1B model, kept to the end of the process, so the plan's quality
    measurement then loaded two models at once and a 3B model ran out of 24 GB). Returns how many it dropped;
    never raises (a pulp that keeps them elsewhere only costs the memory)."""
    dropped, seen = 0, set()
    try:
        for module in list(vars(pulp.apis).values()):
            for value in list(vars(module).values()) if isinstance(module, type(pulp)) else ():
                pending = [vars(value).get("err")] if isinstance(value, type) else []
                while pending:
                    err = pending.pop()
                    if not isinstance(err, BaseException) or id(err) in seen:
                        continue
                    seen.add(id(err))
                    dropped += err.__traceback__ is not None
                    err.__traceback__ = None
                    pending += [err.__context__, err.__cause__]
    except Exception:  # noqa: BLE001 (best effort on pulp's internals)
        pass
    return dropped


release_pulp_import_frames()

MICROSECONDS = 1e6
# The budget row stops 1 ppm (+ 1 byte) short: where every unit fits exactly, CBC's feasibility tolerance
# (about 1e-7 relative) let it find the all-GPU point, then "prove" the problem infeasible and hand back the
# greedy warm start as optimal (2.8x slower for SmolLM2 on the h100 preset)
CAPACITY_MARGIN_REL = 1e-6


@dataclass(frozen=True)
class SolverSettings:
    time_limit_s: float = 30.0
    gap_rel: float = 1e-3
    hot_prefix: bool = True  # a layer's GPU chunks are its hottest ones (PowerInfer's ordering)
    threads: int = 1

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0:
            raise TandemError(f"solver time limit must be positive, got {self.time_limit_s}")
        if not 0 <= self.gap_rel < 1:
            raise TandemError(f"relative gap must be in [0, 1), got {self.gap_rel}")


@dataclass(frozen=True)
class SolveResult:
    placement: Placement
    chosen: str  # "ilp" | "greedy"
    status: str  # "optimal" | "feasible (time limit)" | "no solution" | ...
    gap_rel: float | None  # relative gap of the kept placement (an upper bound), None when unknown
    solve_time_s: float
    ilp_objective_s: float | None  # modeled seconds per token of the ILP's own solution
    greedy_objective_s: float
    note: str = ""

    @property
    def objective_s(self) -> float:
        if self.chosen == "ilp" and self.ilp_objective_s is not None:
            return self.ilp_objective_s
        return self.greedy_objective_s


class _Model:
    """Builds the PuLP problem; keeps the variables to read the placement back.

    Dense layers use a disjunctive formulation over three modes (all on the CPU, all on the GPU,
    mixed): the sync cost belongs to the mixed mode, and the mixed mode's own variables are bounded
    by its mode variable, so the LP relaxation is the convex hull of the three modes (tight bounds,
    fast proofs). MoE layers enumerate (attention, shared expert, expert option) combinations.
    """

    def __init__(self, problem: PlacementProblem, hot_prefix: bool):
        self.problem = problem
        self.lp = pulp.LpProblem("tandem_placement", pulp.LpMinimize)
        self.objective_terms: list = []
        self.memory_terms: list = []
        self.layer_mode: dict[int, tuple] = {}  # i -> (all_cpu, all_gpu, mixed)
        self.attention_on_gpu_mixed, self.predictor_on_gpu_mixed = {}, {}
        self.chunk_on_gpu_mixed, self.ffn_time_mixed_us = {}, {}
        self.moe_combination: dict[int, list] = {}  # i -> [(variable, attention, shared, option)]
        for i, layer in enumerate(problem.layers):
            if layer.is_moe:
                self._add_moe_layer(i, layer)
            else:
                self._add_dense_layer(i, layer, hot_prefix)
        head = problem.output_head
        self.output_head_on_gpu = self._binary_unit("output_head_on_gpu", head.gpu_bytes, head.gpu_s, head.cpu_s)
        self.embeddings_on_gpu = None
        if problem.embeddings is not None:
            emb = problem.embeddings
            self.embeddings_on_gpu = self._binary_unit("embeddings_on_gpu", emb.gpu_bytes, emb.gpu_s, emb.cpu_s)
        self._add_cpu_runs(problem)
        self.lp += pulp.lpSum(self.objective_terms)
        capacity_mib = problem.capacity_bytes / MiB * (1 - CAPACITY_MARGIN_REL) - 1e-6
        self.lp += pulp.lpSum(self.memory_terms) <= capacity_mib, "gpu_budget"

    def _add_cpu_runs(self, problem: PlacementProblem) -> None:
        """Runs of all-CPU dense layers: a host call each (cost_model.cpu_run_starts), and a sync where the residual
        stream enters one from the GPU, after a layer using it or the GPU's embedding (entered_cpu_layers); a sync
        + call for an output layer on the CPU after a layer that used the GPU (head_after_gpu). A mixed layer's
        call is in its mode."""
        call_us, sync_us = problem.cpu_call_s * MICROSECONDS, problem.layer_sync_s * MICROSECONDS
        emb = self.embeddings_on_gpu if self.embeddings_on_gpu is not None else self.output_head_on_gpu
        for i in self.layer_mode:
            all_cpu = self.layer_mode[i][0]
            if i - 1 in self.layer_mode:  # after a dense layer: one run start, entered from the GPU
                if call_us + sync_us > 0:
                    start = self._var(f"cpu_run_start_{i}", lowBound=0)
                    self.lp += start >= all_cpu - self.layer_mode[i - 1][0], f"cpu_run_start_{i}"
                    self.objective_terms.append((call_us + sync_us) * start)
                continue
            if call_us > 0:  # the first layer, or after a MoE layer (not entered)
                self.objective_terms.append(call_us * all_cpu)
            if i == 0 and sync_us > 0:
                entry = self._var("cpu_entry_0", lowBound=0)
                self.lp += entry >= all_cpu - (1 - emb), "cpu_entry_0"  # after the GPU's embedding
                self.objective_terms.append(sync_us * entry)
        last = len(problem.layers) - 1
        if call_us + sync_us > 0 and last in self.layer_mode:
            head_after = self._var("head_after_gpu", lowBound=0)
            self.lp += head_after >= 1 - self.output_head_on_gpu - self.layer_mode[last][0], "head_after_gpu"
            self.objective_terms.append((call_us + sync_us) * head_after)

    def _var(self, name: str, cat: str = "Continuous", lowBound: float | None = None,
             upBound: float | None = None) -> pulp.LpVariable:
        if hasattr(self.lp, "add_variable"):  # PuLP >= 3.3
            return self.lp.add_variable(name, lowBound=lowBound, upBound=upBound, cat=cat)
        return pulp.LpVariable(name, lowBound=lowBound, upBound=upBound, cat=cat)

    def _binary_unit(self, name: str, gpu_bytes: int, gpu_s: float, cpu_s: float) -> pulp.LpVariable:
        var = self._var(name, cat="Binary")
        self.objective_terms.append(cpu_s * MICROSECONDS + (gpu_s - cpu_s) * MICROSECONDS * var)
        self.memory_terms.append(gpu_bytes / MiB * var)
        return var

    def _add_dense_layer(self, i: int, layer, hot_prefix: bool) -> None:
        all_cpu = self._var(f"layer_all_cpu_{i}", cat="Binary")
        all_gpu = self._var(f"layer_all_gpu_{i}", cat="Binary")
        mixed = self._var(f"layer_mixed_{i}", cat="Binary")  # pays the sync
        self.layer_mode[i] = (all_cpu, all_gpu, mixed)
        self.lp += all_cpu + all_gpu + mixed == 1, f"one_mode_{i}"
        attention, predictor = layer.attention, layer.predictor
        ffn_cpu_total, ffn_gpu_total = float(layer.chunk_cpu_s.sum()), float(layer.chunk_gpu_s.sum())
        # all on the GPU: no cold rows, so no predictor (it gates cold rows only; cost_model.evaluate_layer)
        cpu_time = attention.cpu_s + ffn_cpu_total + (predictor.cpu_s if predictor and layer.num_chunks else 0.0)
        gpu_time = attention.gpu_s + ffn_gpu_total + (layer.ffn_launch_s if layer.num_chunks else 0.0)
        gpu_bytes = attention.gpu_bytes + int(layer.chunk_gpu_bytes.sum())
        mixed_base = attention.cpu_s + self.problem.mixed_layer_s
        self.objective_terms += [cpu_time * MICROSECONDS * all_cpu, gpu_time * MICROSECONDS * all_gpu,
                                 mixed_base * MICROSECONDS * mixed]
        self.memory_terms.append(gpu_bytes / MiB * all_gpu)
        # mixed mode: each unit's own choice, bounded by the mode
        attention_mixed = self._var(f"attention_on_gpu_mixed_{i}", cat="Binary")
        self.attention_on_gpu_mixed[i] = attention_mixed
        self.lp += attention_mixed <= mixed, f"attention_in_mixed_{i}"
        self.objective_terms.append((attention.gpu_s - attention.cpu_s) * MICROSECONDS * attention_mixed)
        self.memory_terms.append(attention.gpu_bytes / MiB * attention_mixed)
        chunks = [self._var(f"chunk_on_gpu_mixed_{i}_{c}", cat="Binary") for c in range(layer.num_chunks)]
        self.chunk_on_gpu_mixed[i] = chunks
        all_hot = None  # = min(chunks) at the optimum: the mixed layer has no cold rows
        if layer.merge_launch_s > 0 or predictor is not None:
            all_hot = self._var(f"all_hot_mixed_{i}", lowBound=0, upBound=1)
            for c, x in enumerate(chunks):
                self.lp += all_hot <= x, f"all_hot_{i}_{c}"
        if predictor is not None:
            predictor_cpu = self._var(f"predictor_on_cpu_mixed_{i}", lowBound=0)  # cold rows gated on the host
            needed = mixed - all_hot
            if predictor.gpu_s < predictor.cpu_s:  # only a predictor that runs faster there is worth GPU bytes
                predictor_mixed = self._var(f"predictor_on_gpu_mixed_{i}", cat="Binary")
                self.predictor_on_gpu_mixed[i] = predictor_mixed
                self.lp += predictor_mixed <= mixed, f"predictor_in_mixed_{i}"
                self.objective_terms.append(predictor.gpu_s * MICROSECONDS * predictor_mixed)
                self.memory_terms.append(predictor.gpu_bytes / MiB * predictor_mixed)
                needed = needed - predictor_mixed
            self.lp += predictor_cpu >= needed, f"predictor_cpu_{i}"
            self.objective_terms.append(predictor.cpu_s * MICROSECONDS * predictor_cpu)
        sizes = layer.chunk_sizes
        if hot_prefix:
            ffn_uses_gpu = chunks[0]
            for c in range(1, len(chunks)):
                self.lp += chunks[c] <= chunks[c - 1], f"hot_first_{i}_{c}"
        else:
            ffn_uses_gpu = self._var(f"layer_ffn_uses_gpu_mixed_{i}", cat="Binary")
            for c, x in enumerate(chunks):
                self.lp += x <= ffn_uses_gpu, f"ffn_gpu_flag_{i}_{c}"
        self.lp += ffn_uses_gpu <= mixed, f"ffn_in_mixed_{i}"
        self.lp += pulp.lpSum(int(n) * x for n, x in zip(sizes, chunks)) >= layer.min_gpu_neurons * ffn_uses_gpu, f"min_or_none_{i}"
        self.memory_terms += [int(b) / MiB * x for b, x in zip(layer.chunk_gpu_bytes, chunks)]
        ffn_time = self._var(f"ffn_time_mixed_us_{i}", lowBound=0)  # max(GPU part, CPU part)
        self.ffn_time_mixed_us[i] = ffn_time
        self.lp += ffn_time >= pulp.lpSum(g * MICROSECONDS * x for g, x in zip(layer.chunk_gpu_s, chunks)) \
            + layer.ffn_launch_s * MICROSECONDS * ffn_uses_gpu, f"ffn_time_covers_gpu_{i}"
        if layer.merge_launch_s > 0:  # mixed with cold rows: their output merged on the GPU (cost_model.evaluate_layer)
            merge = self._var(f"merge_mixed_{i}", lowBound=0)
            self.lp += merge >= mixed - all_hot, f"merge_{i}"
            self.objective_terms.append(layer.merge_launch_s * MICROSECONDS * merge)
        self.lp += ffn_time >= ffn_cpu_total * MICROSECONDS * mixed - pulp.lpSum(
            c * MICROSECONDS * x for c, x in zip(layer.chunk_cpu_s, chunks)), f"ffn_time_covers_cpu_{i}"
        self.objective_terms.append(ffn_time)

    def _add_moe_layer(self, i: int, layer) -> None:
        combos = []
        shared_choices = (False, True) if layer.shared_expert is not None else (False,)
        for attention in (False, True):
            for shared in shared_choices:
                for k in range(len(layer.expert_options)):
                    time, kinds, _ = evaluate_layer(layer, self.problem.mixed_layer_s, attention, False,
                                                    np.zeros(0, dtype=bool), k, shared)
                    var = self._var(f"moe_choice_{i}_{int(attention)}_{int(shared)}_{k}", cat="Binary")
                    combos.append((var, attention, shared, k))
                    self.objective_terms.append(time.total_s * MICROSECONDS * var)
                    self.memory_terms.append(sum(kinds.values()) / MiB * var)
        self.moe_combination[i] = combos
        self.lp += pulp.lpSum(c[0] for c in combos) == 1, f"one_moe_choice_{i}"

    def warm_start(self, placement: Placement) -> None:
        """Initial values from a known-feasible placement (CBC starts from it)."""
        evaluation = evaluate_placement(self.problem, placement)
        for i, (all_cpu, all_gpu, mixed) in self.layer_mode.items():
            layer = self.problem.layers[i]
            flags = [bool(placement.attention_on_gpu[i])] + [bool(x) for x in placement.gpu_chunks[i]]
            predictor_gpu = layer.predictor is not None and bool(placement.predictor_on_gpu[i])
            # all on the GPU leaves the predictor out (nothing to gate): dropping it frees bytes, costs no time
            mode = "gpu" if all(flags) else "cpu" if not any(flags) and not predictor_gpu else "mixed"
            all_cpu.setInitialValue(int(mode == "cpu"))
            all_gpu.setInitialValue(int(mode == "gpu"))
            mixed.setInitialValue(int(mode == "mixed"))
            in_mixed = mode == "mixed"
            self.attention_on_gpu_mixed[i].setInitialValue(int(in_mixed and placement.attention_on_gpu[i]))
            if i in self.predictor_on_gpu_mixed:
                self.predictor_on_gpu_mixed[i].setInitialValue(int(in_mixed and placement.predictor_on_gpu[i]))
            for c, var in enumerate(self.chunk_on_gpu_mixed[i]):
                var.setInitialValue(int(in_mixed and placement.gpu_chunks[i][c]))
            self.ffn_time_mixed_us[i].setInitialValue(evaluation.layers[i].ffn_s * MICROSECONDS if in_mixed else 0.0)
        for i, combos in self.moe_combination.items():
            for var, attention, shared, k in combos:
                chosen = (attention == bool(placement.attention_on_gpu[i]) and k == placement.expert_option[i]
                          and shared == bool(placement.shared_expert_on_gpu[i]))
                var.setInitialValue(int(chosen))
        self.output_head_on_gpu.setInitialValue(int(placement.output_head_on_gpu))
        if self.embeddings_on_gpu is not None:
            self.embeddings_on_gpu.setInitialValue(int(placement.embeddings_on_gpu))

    def read_placement(self) -> Placement:
        def on(var) -> bool:
            return var is not None and var.varValue is not None and var.varValue > 0.5
        count = len(self.problem.layers)
        attention, predictor = [False] * count, [False] * count
        chunks = [np.zeros(0, dtype=bool)] * count
        options, shared = [0] * count, [False] * count
        for i, (_, all_gpu, mixed) in self.layer_mode.items():
            gpu_mode = on(all_gpu)
            attention[i] = gpu_mode or on(self.attention_on_gpu_mixed[i])
            predictor[i] = self.problem.layers[i].predictor is not None and on(self.predictor_on_gpu_mixed.get(i))
            chunks[i] = np.array([gpu_mode or on(x) for x in self.chunk_on_gpu_mixed[i]], dtype=bool)
        for i, combos in self.moe_combination.items():
            _, attention[i], shared[i], options[i] = max(combos, key=lambda c: c[0].varValue or 0.0)
        head = on(self.output_head_on_gpu)
        return Placement(attention_on_gpu=attention, predictor_on_gpu=predictor, gpu_chunks=chunks,
                         expert_option=options, shared_expert_on_gpu=shared, output_head_on_gpu=head,
                         embeddings_on_gpu=on(self.embeddings_on_gpu) if self.embeddings_on_gpu is not None else head)


def _parse_cbc_log(text: str) -> tuple[str, float | None, float | None]:
    """(result line, objective, lower bound) from CBC's final summary (solver units, no constant)."""
    result = re.search(r"^Result - (.+)$", text, re.M)
    objective = re.search(r"^Objective value:\s+(\S+)", text, re.M)
    bound = re.search(r"^Lower bound:\s+(\S+)", text, re.M)
    def number(m):
        try:
            return float(m.group(1)) if m else None
        except ValueError:
            return None
    return (result.group(1).strip() if result else ""), number(objective), number(bound)


def solve_placement(problem: PlacementProblem, greedy: Placement, settings: SolverSettings = SolverSettings()) -> SolveResult:
    """Solve the ILP within the time limit; never return something worse than ``greedy``."""
    greedy_eval = evaluate_placement(problem, greedy)
    greedy_s = greedy_eval.time_per_token_s
    if not problem.hardware.has_gpu or problem.capacity_bytes <= 0:
        return SolveResult(placement=greedy, chosen="greedy", status="not needed (nothing fits on a GPU)",
                           gap_rel=0.0, solve_time_s=0.0, ilp_objective_s=None, greedy_objective_s=greedy_s,
                           note="all-CPU placement")
    start = time.perf_counter()
    model = _Model(problem, settings.hot_prefix)
    model.warm_start(greedy)
    with tempfile.TemporaryDirectory(prefix="tandem-cbc-") as tmp:
        log_path = Path(tmp) / "cbc.log"
        remaining_s = max(1.0, settings.time_limit_s - (time.perf_counter() - start))
        with warnings.catch_warnings():  # PuLP 3.3 announces PULP_CBC_CMD's removal in 4.0
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=remaining_s, gapRel=settings.gap_rel, warmStart=True,
                                       logPath=str(log_path), threads=settings.threads)
        try:
            model.lp.solve(solver)
        except pulp.PulpSolverError as e:
            raise TandemError(f"the ILP solver failed: {str(e).splitlines()[0]}") from None
        log_text = log_path.read_text() if log_path.exists() else ""
    solve_time_s = time.perf_counter() - start
    result_line, _, cbc_bound = _parse_cbc_log(log_text)
    has_solution = model.lp.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if not has_solution:
        return SolveResult(placement=greedy, chosen="greedy", status=f"no solution ({result_line or pulp.LpStatus[model.lp.status]})",
                           gap_rel=None, solve_time_s=solve_time_s, ilp_objective_s=None, greedy_objective_s=greedy_s,
                           note="the solver found no solution in time; greedy kept")
    status = "optimal" if model.lp.sol_status == pulp.LpSolutionOptimal and "time" not in result_line.lower() \
        else "feasible (time limit)"
    ilp_placement = model.read_placement()
    ilp_eval = evaluate_placement(problem, ilp_placement)
    ilp_s = ilp_eval.time_per_token_s
    # CBC reports its bound without the objective's constant terms
    lower_bound_s = None
    if cbc_bound is not None:
        lower_bound_s = (cbc_bound + model.lp.objective.constant) / MICROSECONDS

    def gap_for(seconds: float) -> float | None:
        """Relative gap of a kept placement: proven by CBC's bound, or the tolerance when optimal."""
        if lower_bound_s is not None:
            gap = max(seconds - lower_bound_s, 0.0) / seconds
            return min(gap, settings.gap_rel) if status == "optimal" else gap
        return settings.gap_rel if status == "optimal" else None
    problems = []
    if ilp_eval.gpu_bytes > problem.gpu_budget_bytes:
        problems.append("it exceeds the budget")
    if ilp_eval.min_rule_violations:
        problems.append("it breaks the minimum-or-none rule")
    if problems:
        return SolveResult(placement=greedy, chosen="greedy", status=status, gap_rel=gap_for(greedy_s),
                           solve_time_s=solve_time_s, ilp_objective_s=ilp_s, greedy_objective_s=greedy_s,
                           note=f"the solver's placement was rejected ({' and '.join(problems)}); greedy kept")
    if ilp_s > greedy_s:
        return SolveResult(placement=greedy, chosen="greedy", status=status, gap_rel=gap_for(greedy_s),
                           solve_time_s=solve_time_s, ilp_objective_s=ilp_s, greedy_objective_s=greedy_s,
                           note="the solver's placement models slower than greedy; greedy kept")
    return SolveResult(placement=ilp_placement, chosen="ilp", status=status, gap_rel=gap_for(ilp_s),
                       solve_time_s=solve_time_s, ilp_objective_s=ilp_s, greedy_objective_s=greedy_s)
