"""Not boto3: the processes the suite starts (trainers, launchers, CLIs) run as where boto3 is
not installed (jaxdist reads and writes S3 through s3fs and botocore, not boto3).
tensorboardX imports it at start-up for an S3 event writer jaxdist never asks for: a fifth of a
second of CPU in each process that logs. The test workers keep it (moto's S3 server needs it);
``helpers.subprocess_env`` puts this folder first on the started processes' path."""

raise ImportError("boto3 is hidden from the processes the test suite starts (tests/hidden)")
