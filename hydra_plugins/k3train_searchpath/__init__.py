"""Hydra finds k3train's recipes and config groups through this plugin.

Hydra imports every module of the `hydra_plugins` namespace package it can find, so once k3train is installed the
package recipes (tiny_cpu, small_8gpu, ...) and groups (model/, optim/, ...) are on the search path of any Hydra
app, and a user's recipe given with `--config-dir DIR --config-name NAME` can list `tiny_cpu` or `model: tiny` in
its defaults.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class K3TrainSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from k3train.config.store import configs_dir, recipes_dir

        # Appended: a --config-dir (and the primary config path) come first, so a user's file of the same name wins.
        search_path.append(provider="k3train", path=recipes_dir().as_uri())
        search_path.append(provider="k3train", path=configs_dir().as_uri())
