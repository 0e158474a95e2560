# Sourced before `ray start` on every node of deploy/ray-cluster-aws.yaml: the secrets specbatch needs, read with
# the node's instance role from AWS SSM Parameter Store, go into the environment of `ray start` and so of every
# Ray worker and Ray job on the node; none is written to disk or to the cluster YAML. Store them once, yourself:
#   aws ssm put-parameter --name /specbatch/HF_TOKEN --type SecureString --value "$HF_TOKEN"
# (SPECBATCH_SSM_PREFIX, default /specbatch/, names another folder). S3 needs nothing here: boto3 finds the role.
# A parameter that cannot be read is left unset with a warning (a job with models on S3 needs no HF_TOKEN).
for _name in HF_TOKEN; do
  if _value="$(python -c 'import os, sys, boto3
name = os.environ.get("SPECBATCH_SSM_PREFIX", "/specbatch/") + sys.argv[1]
print(boto3.client("ssm").get_parameter(Name=name, WithDecryption=True)["Parameter"]["Value"])' "$_name" 2>/dev/null)"; then
    export "$_name=$_value"
  else
    echo "launcher-env.sh: could not read ${SPECBATCH_SSM_PREFIX:-/specbatch/}$_name from SSM; $_name left unset" >&2
  fi
done
unset _name _value
