"""The model side of rcpu-bench, and the stable import location of the plugin-facing API.

Plugins import from here (``from rcpu_bench.model import capture_layer_inputs, ...``); these names and
their signatures are kept stable (tests/test_adapter.py checks them):

- the adapter: ``model_view(model)``, ``layer_view(layer)`` and their ``ModelView`` / ``LayerView``
  (projections, geometry, units, ``apply``), ``LayerGeometry``, ``UnitMap``, and ``MODULES`` (the names
  of a layer's prunable modules: ``"attention"``, ``"mlp"``);
- capture: ``LayerInput``, ``capture_layer_inputs(model, input_ids, batch_size, device)``,
  ``run_layer(layer, inputs)``;
- loading and saving: ``LoadedModel``, ``load_model``, ``parameter_count``, ``save_pruned``,
  ``load_pruned``, ``load_saved``, and for a model method's own saver ``MANIFEST``,
  ``write_atomically(directory, write, *, overwrite)``, ``file_sha256(path)`` (record it as
  ``"sha256": {weights: digest}``), ``recorded_sha256(manifest, where)`` (read it back) and
  ``materialize(skeleton, directory, ..., sha256=...)`` (verifies it).
"""

from rcpu_bench.atomic_file import file_sha256, write_atomically
from rcpu_bench.model.adapter import check_architecture, decoder_layers, layer_view, model_view
from rcpu_bench.model.capture import LayerInput, capture_layer_inputs, run_layer
from rcpu_bench.model.loading import LoadedModel, dtype_argument, load_model, parameter_count, resolve_dtype
from rcpu_bench.model.manifest import MANIFEST, recorded_sha256
from rcpu_bench.model.persistence import load_pruned, load_saved, materialize, save_pruned
from rcpu_bench.model.views import MODULES, LayerGeometry, LayerView, ModelView
from rcpu_bench.selection.select import UnitMap

__all__ = ["MANIFEST", "MODULES", "LayerGeometry", "LayerInput", "LayerView", "LoadedModel", "ModelView", "UnitMap",
           "capture_layer_inputs", "check_architecture", "decoder_layers", "dtype_argument", "file_sha256",
           "layer_view",
           "load_model", "load_pruned", "load_saved", "materialize", "model_view", "parameter_count", "recorded_sha256",
           "resolve_dtype",
           "run_layer", "save_pruned", "write_atomically"]
