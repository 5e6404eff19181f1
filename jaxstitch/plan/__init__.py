"""Planning: from a region to a frozen kernel plan (layout, thread mapping, cost), no strings of code."""
from .planner import KernelPlan, Mapping, RegionPlan, plan_region  # noqa: F401
from .layout import Unplannable  # noqa: F401
