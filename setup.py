from setuptools import find_packages, setup

setup(
    name="opencood",
    version="0.1.0",
    description="Cooperative 3D object detection: OPV2V data, synthetic world, fusion models, "
                "distributed training and evaluation.",
    packages=find_packages(include=["opencood", "opencood.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "torchvision",
        "numpy",
        "pyyaml",
        "tensorboard",
        "opencv-python-headless",
        "tqdm",
    ],
)
