-- Argo CD health check for splitserve.dev/InferenceService.
-- Reads the kstatus conditions the operator writes: Stalled=True is Degraded,
-- Reconciling=True or a status older than the spec is Progressing, Ready=True is Healthy.
-- Install under resource.customizations.health.splitserve.dev_InferenceService in argocd-cm.
local hs = {status = "Progressing", message = "Waiting for the operator to report status"}
if obj.metadata ~= nil and obj.metadata.annotations ~= nil
    and obj.metadata.annotations["splitserve.dev/paused"] == "true" then
  return {status = "Suspended", message = "Reconciliation is paused (splitserve.dev/paused)"}
end
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end
local byType = {}
for _, condition in ipairs(obj.status.conditions) do
  byType[condition.type] = condition
end
local function describe(condition)
  local text = condition.reason or ""
  if condition.message ~= nil and condition.message ~= "" then
    text = text .. ": " .. condition.message
  end
  return text
end
local stalled = byType["Stalled"]
if stalled ~= nil and stalled.status == "True" then
  return {status = "Degraded", message = describe(stalled)}
end
local reconciling = byType["Reconciling"]
if reconciling ~= nil and reconciling.status == "True" then
  return {status = "Progressing", message = describe(reconciling)}
end
local ready = byType["Ready"]
if ready ~= nil and ready.status == "True" then
  return {status = "Healthy", message = describe(ready)}
end
if ready ~= nil then
  hs.message = describe(ready)
end
return hs
