from setuptools import find_packages, setup

setup(
    name="opencood",
    version="0.1.0",
    description="Cooperative 3D object detection: OPV2V data, synthetic world, fusion models, "
                "distributed training and evaluation.",
    packages=find_packages(include=["opencood", "opencood.*"]),
    python_requires=">=3.10",
    # Ranges, not pins: a library must install beside a cluster's own torch. requirements.txt
    # pins the versions the tests run with.
    install_requires=[
        "torch>=2.11,<2.15",
        "torchvision>=0.26",
        "numpy>=1.24,<3",
        "pyyaml>=6.0,<7",
        "tensorboard>=2.14,<3",
        "opencv-python-headless>=4.8,<6",
        "tqdm>=4.64,<5",
    ],
    extras_require={"test": ["pytest==9.2.0"]},
)
