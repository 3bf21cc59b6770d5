"""Memory budget (Adacc): ``compress_gnn(model, memory_budget="16GiB")`` chooses per saved
tensor keep / compress at b bits / recompute / swap so that a training step fits and runs
fastest. `planner` holds the program, `profile` the measurements, `apply` the wiring (the
planner that runs each step), `units` the profile model (measurements to units and options),
`measure` a profile step's figures from its meters, `selection` the choice of plan from
those figures, `state` the plan in force and its size classes, `rectifier` the re-plan after
a step over the budget, `report` the report, `errors` the refusal."""

from gact_graph.budget.apply import DEFAULT_MARGIN, BudgetPlanner, attach_budget
from gact_graph.budget.errors import NAMED_SLACK, NAMED_SLACK_BYTES, BudgetError
from gact_graph.budget.planner import Option, Plan, Unit, greedy_plan, smallest_memory, solve_plan

__all__ = [
    "DEFAULT_MARGIN",
    "NAMED_SLACK",
    "NAMED_SLACK_BYTES",
    "BudgetError",
    "BudgetPlanner",
    "attach_budget",
    "Option",
    "Plan",
    "Unit",
    "greedy_plan",
    "smallest_memory",
    "solve_plan",
]
