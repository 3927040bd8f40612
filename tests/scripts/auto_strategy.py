"""Under `paraml launch -n 2`: Parallel("auto") must pick multi_worker from TF_CONFIG."""

from paraml import Parallel

par = Parallel("auto")
print(f"strategy={par.strategy} workers={par.num_workers} | {par.explain()}", flush=True)
