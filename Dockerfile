FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY stepscope ./stepscope
COPY migrations ./migrations
# A regular install: the wheel carries the Alembic migrations as stepscope.migrations.
RUN pip install --no-cache-dir '.[server]' && rm -rf /app/*
EXPOSE 8000
CMD ["stepscope", "serve", "--host", "0.0.0.0", "--port", "8000", "--auth"]
