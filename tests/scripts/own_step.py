"""A model with its own train_step, shared by multi_worker_train.py and the test that checks it against Keras."""

import keras
import tensorflow as tf


class OwnStep(keras.Model):
    """Keras' fit breaks under MultiWorkerMirroredStrategy (keras-team/keras#20585); paraml runs this step."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"mse": loss * tf.distribute.get_strategy().num_replicas_in_sync}


def own_step_model() -> keras.Model:
    inputs = keras.Input((8, 8))  # the digits
    return OwnStep(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(inputs)))
