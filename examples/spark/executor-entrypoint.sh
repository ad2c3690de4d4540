#!/bin/sh
# Entry point of the image: "executor" runs a Spark executor as Spark's Kubernetes scheduler
# starts it (its settings arrive in SPARK_* variables); anything else runs as a command.
set -e
if [ "$1" = "executor" ]; then
  exec java -Xms"${SPARK_EXECUTOR_MEMORY:-1g}" -Xmx"${SPARK_EXECUTOR_MEMORY:-1g}" \
    -cp "/opt/spark/jars/*" $SPARK_JAVA_OPT_0 $SPARK_JAVA_OPT_1 \
    org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend \
    --driver-url "$SPARK_DRIVER_URL" --executor-id "$SPARK_EXECUTOR_ID" \
    --cores "${SPARK_EXECUTOR_CORES:-1}" --app-id "$SPARK_APPLICATION_ID" \
    --hostname "$SPARK_EXECUTOR_POD_IP" --resourceProfileId "${SPARK_RESOURCE_PROFILE_ID:-0}" \
    --podName "$SPARK_EXECUTOR_POD_NAME"
fi
exec "$@"
