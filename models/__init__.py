"""Reference models (BERT, GPT-2, VGG416, ResNet1K) with size presets; each file is also a model file."""
