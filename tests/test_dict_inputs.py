"""A keras_hub backbone under the user's own head, with dict inputs (``keras.Input`` per key): the most common way to
put a head on a backbone. The probe batch is keyed as the model's inputs dict is, so the memory estimate measures
the model and ``tensor_parallel`` builds and trains it."""

import keras
import keras_hub
import numpy as np
import pytest
from test_model_parallel import token_data, token_loss
from test_tensor_parallel import assert_same_training, trained

from paraml import estimate_memory
from paraml.planning.observe import observe_units, probe_inputs


def gpt2_with_a_head() -> keras.Model:
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=100,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=16,
        dropout=0.0,
    )
    inputs = {  # unnamed: Keras names the tensors keras_tensor_N, the dict's keys are what the model is called with
        "token_ids": keras.Input((None,), dtype="int32"),
        "padding_mask": keras.Input((None,), dtype="int32"),
    }
    return keras.Model(inputs, keras.layers.Dense(100)(backbone(inputs)))


def test_the_probe_is_keyed_as_the_models_inputs_dict() -> None:
    model = gpt2_with_a_head()
    probe, had_unknown = probe_inputs(model)
    assert set(probe) == {"token_ids", "padding_mask"} and had_unknown
    assert probe["token_ids"].dtype == np.int32
    observation = observe_units(model)
    assert observation.problem == "" and observation.gradient_problem == ""
    estimate = estimate_memory(model, batch_size=16)
    assert "could not" not in estimate.note and estimate.activations > 0


@pytest.mark.slow
def test_tensor_parallel_builds_and_trains_the_dict_input_head_as_single() -> None:
    reference, want = trained("single", gpt2_with_a_head, token_data(), token_loss)
    par, got = trained("model_parallel", gpt2_with_a_head, token_data(), token_loss, devices=2, tensor_parallel=2)
    assert par.plan.splits.splits  # its attention, feed-forward and head are split
    assert_same_training(par, reference, got, want, token_data()[0])
