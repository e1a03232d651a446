"""The training loss: cross-entropy from logits with integer labels and label smoothing."""

from __future__ import annotations

import keras


@keras.saving.register_keras_serializable(package="cifar")
class SparseCrossentropyWithSmoothing(keras.losses.Loss):
    """Cross-entropy from logits with integer labels and label smoothing (Keras' sparse loss has none)."""

    def __init__(self, label_smoothing: float = 0.0, num_classes: int = 10, name: str = "crossentropy", **kwargs):
        super().__init__(name=name, **kwargs)
        self.label_smoothing = float(label_smoothing)
        self.num_classes = int(num_classes)

    def call(self, y_true, y_pred):
        one_hot = keras.ops.one_hot(keras.ops.cast(keras.ops.reshape(y_true, [-1]), "int32"), self.num_classes)
        return keras.losses.categorical_crossentropy(
            one_hot, y_pred, from_logits=True, label_smoothing=self.label_smoothing
        )

    def get_config(self) -> dict:
        return {**super().get_config(), "label_smoothing": self.label_smoothing, "num_classes": self.num_classes}
