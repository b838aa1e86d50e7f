# The team's MLflow tracking server: PostgreSQL backend (psycopg2), artifacts proxied to S3 (boto3).
# Keep MLFLOW_VERSION close to the replaybisect image's mlflow (client and server of one major version).
FROM python:3.11-slim
ARG MLFLOW_VERSION=3.17.2
RUN pip install --no-cache-dir "mlflow==${MLFLOW_VERSION}" psycopg2-binary boto3
EXPOSE 5000
ENTRYPOINT ["mlflow"]
