"""snapkv-bench's Hydra plugins, found by Hydra's scan of the `hydra_plugins` namespace (Hydra only
accepts launchers defined there, and imports this package before it composes any config):

- the method configs' fields (`eval.conf.register_method_configs`): every conf/method/*.yaml
  extends the `method_fields_<name>` config generated from its method's dataclass;
- `_slurm.SlurmLauncher`, the launcher of `hydra/launcher=slurm`. Only with the `cluster` extra
  (hydra-submitit-launcher): without it there is no SLURM launcher to extend, and an ImportError
  during Hydra's scan would be a warning on every run.
"""

import importlib.util

from eval.conf import register_method_configs

register_method_configs()

if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None:
    from hydra_plugins.snapkv_bench._slurm import SlurmLauncher

    __all__ = ["SlurmLauncher"]
