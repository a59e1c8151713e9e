FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY stepscope ./stepscope
COPY migrations ./migrations
# Editable install: the server finds its Alembic migrations in /app/migrations.
RUN pip install --no-cache-dir -e '.[server]'
EXPOSE 8000
CMD ["stepscope", "serve", "--host", "0.0.0.0", "--port", "8000", "--auth"]
