"""Where files live: local folders and object storage (s3://, gs://, hdfs://) through fsspec."""
